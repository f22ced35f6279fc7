"""After the sweep: set in the candidate templates the variants that beat 'new' (rules below); print them."""
import json, sys
from pathlib import Path
sys.path.insert(0, "/tmp/src/tests")
import tune_decode_variants as tv

runs = json.load(open(sys.argv[1]))
dst = Path(sys.argv[2])
def ms(v, c):
    r = [x for x in runs if x["variant"] == v and x["case"] == c and x["rule"]]
    if not r or not (r[0]["err"] < 1e-2):
        return None
    return r[0]["ms_median"]
adopted = []
n64, n1, ng = ms("new", "b64x4096"), ms("new", "b1x32768"), ms("new", "gemma2-b64x8192")
for v in ("noqz", "mb32"):
    a64, a1 = ms(v, "b64x4096"), ms(v, "b1x32768")
    if a64 is None or a1 is None:
        continue
    if v == "noqz" and a64 <= 0.99 * n64 and a1 <= 1.005 * n1:
        adopted.append(v)
    if v == "mb32" and a1 <= 0.985 * n1 and a64 <= 1.005 * n64:
        adopted.append(v)
g = [(ms(v, "gemma2-b64x8192"), v) for v in tv.VARIANTS if v.startswith("g-")]
g = [x for x in g if x[0] is not None]
if g and min(g)[0] <= 0.98 * ng:
    adopted.append(min(g)[1])
for v in adopted:
    tv.apply(dst, tv.VARIANTS[v][0])
print("ADOPTED:", adopted or "none", "| new ms:", n64, n1, ng)
