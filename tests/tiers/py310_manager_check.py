"""Python 3.10 check of the tier manager without torch: load hybridkv.tiers.manager
with stub parent packages (their __init__ imports torch), then time out a slow read."""
import sys, types, time, importlib, concurrent.futures
root = sys.argv[1]
for name, path in (("hybridkv", f"{root}/hybridkv"), ("hybridkv.tiers", f"{root}/hybridkv/tiers"),
                   ("hybridkv.tiers.storage", f"{root}/hybridkv/tiers/storage")):
    m = types.ModuleType(name); m.__path__ = [path]; sys.modules[name] = m
mgr_mod = importlib.import_module("hybridkv.tiers.manager")
assert concurrent.futures.TimeoutError is not TimeoutError or sys.version_info >= (3, 11)

class Slow:
    def exists(self, keys): time.sleep(0.5); return [True] * len(keys)
    def get(self, keys): time.sleep(0.5); return [b"v"] * len(keys)
    def get_into(self, keys, bufs): return [-1] * len(keys)
    def put(self, keys, values): time.sleep(0.5); return [True] * len(keys)
    def touch(self, keys): pass
    def delete(self, keys): pass
    def close(self): pass
    def stats(self): return {}

m = mgr_mod.TierManager(Slow(), timeout_s=0.05)
t0 = time.monotonic()
assert m.get([b"k" * 16]) == [None]          # raised concurrent.futures.TimeoutError on 3.10 before
assert m.exists([b"k" * 16]) == [False]
assert m.stats()["l3_timeouts"] == 2, m.stats()
m.put_async([b"a" * 16], [b"x"])
assert m.flush(5)
m.close()
print(sys.version.split()[0], "OK: timeouts caught as misses in", round(time.monotonic() - t0, 2), "s")
