#!/usr/bin/env bash
# CI: flatbnn installs like a package. Build a wheel from what git would commit, install it (not editable) into a
# fresh venv, and from a directory outside the checkout: compose a config (--cfg job), one of the user's own
# (--config-dir), train on digits, re-evaluate the run, list the paper rows and lay out one row's sweep.
#   bash .ci/wheel_check.sh PYTHON     (PYTHON: a venv's python holding flatbnn's dependencies, e.g. CI's)
# Nothing downloads (but see the build step below): the fresh venv sees PYTHON's site-packages (torch, hydra, ...)
# through a .pth line, which does not run that venv's own .pth files -- so its editable flatbnn stays out of sight --
# and pip installs with --no-index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${1:?usage: .ci/wheel_check.sh PYTHON}"
REPO="$PWD"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
t0=$SECONDS
before="$(git status --porcelain)"

# what git would commit (tracked, and new files not ignored): no local leftover may be what makes the wheel work
mkdir "$WORK/src"
git ls-files -z --cached --others --exclude-standard | tar -cf - --null -T - | tar -xf - -C "$WORK/src"
# PYTHON's own setuptools when it is new enough for pyproject.toml (torch pulls in a recent one); else an isolated
# build, which fetches the same setuptools as `make setup`'s editable install did
# The copy has no .git: the build records the commit named here (flatbnn/build_info.py), dirty unknown
commit="$(git rev-parse HEAD)"
if "$PY" -c 'import sys, setuptools; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
  FLATBNN_COMMIT="$commit" "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index -w "$WORK/dist" "$WORK/src"
else
  FLATBNN_COMMIT="$commit" "$PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$WORK/src"
fi
wheel="$(ls "$WORK"/dist/flatbnn-*.whl)"

# the venv inside a repository of its own (as a .venv inside another checkout is): its commit must not become the
# installed package's provenance
git -C "$WORK" init -q && git -C "$WORK" -c user.name=ci -c user.email=ci@localhost commit -q --allow-empty -m x
"$PY" -m venv --without-pip "$WORK/venv"
V="$WORK/venv/bin/python"
deps="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$deps" > "$("$V" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/ci_deps.pth"
# --force-reinstall: PYTHON's editable flatbnn of the same version is visible and would count as installed;
# `pip check`: every dependency the wheel declares is there (and no download was needed to get it)
"$PY" -m pip --python "$V" install -q --no-index --no-deps --force-reinstall "$wheel"
"$PY" -m pip --python "$V" check

mkdir "$WORK/elsewhere"
cd "$WORK/elsewhere"
export PATH="$WORK/venv/bin:$PATH" WANDB_MODE=disabled MPLBACKEND=Agg
# a user's shell, not CI's: the smoke sweep dir .ci/run exports would send the row's dry run there
unset PYTHONPATH FLATBNN_COMMIT FLATBNN_REPRODUCE_DIR
fail() { echo "wheel_check: $*" >&2; exit 1; }

where="$("$V" -c 'import flatbnn, flatbnn.resources as r; print(flatbnn.__file__, r.CONFIGS_DIR, r.CHECKOUT)')"
case "$where" in "$WORK/venv/"*"/flatbnn/__init__.py $WORK/venv/"*"/flatbnn/configs None") ;;
  *) fail "flatbnn is not the installed wheel's: $where" ;; esac

flatbnn-train --cfg job dataset=digits model=mlp method=map flatness=sam > job.yaml
grep -q "^  name: digits$" job.yaml && grep -q "_target_: flatbnn.flatness" job.yaml || fail "--cfg job: $(head job.yaml)"

# a user's own config dir adds an option to a shipped group
mkdir -p mine/experiment
printf '# @package _global_\ndefaults:\n  - override /dataset: digits\ntrainer:\n  epochs: 7\n' > mine/experiment/mine.yaml
flatbnn-train --config-dir mine experiment=mine --cfg job > mine.yaml
grep -q "^  epochs: 7$" mine.yaml || fail "--config-dir: trainer.epochs is not 7"

flatbnn-train dataset=digits model=mlp trainer.epochs=1 trainer.progress=false trainer.reliability_diagram=false \
  hydra.run.dir=run > train.out 2>&1 || { cat train.out; fail "training failed"; }
flatbnn-eval run=run > eval.out 2>&1 || { cat eval.out; fail "flatbnn-eval failed"; }
# its messages name the command the user typed, not the checkout's evaluate.py
! flatbnn-eval > noarg.out 2>&1 && grep -q "flatbnn-eval run=<run dir>" noarg.out && ! grep -q "evaluate.py" noarg.out ||
  fail "flatbnn-eval's usage line: $(cat noarg.out)"
COMMIT="$commit" "$V" - <<'EOF' || fail "the installed run's results are wrong"
import importlib.metadata, json, os
import flatbnn
run = json.load(open("run/results.json"))
again = json.load(open("run/eval/default/results.json"))
acc = run["metrics"]["accuracy"]
assert acc > 0.5, f"digits accuracy {acc} after an epoch (chance: 0.1)"
assert again["metrics"]["accuracy"] == acc, (again["metrics"]["accuracy"], acc)
# an installed wheel has no history: the commit is the one it was built from (recorded at build time), never that of
# a repository that happens to enclose the venv; and the run names flatbnn's version
assert run["meta"]["git"] == {"commit": os.environ["COMMIT"], "dirty": None}, run["meta"]["git"]
assert run["meta"]["flatbnn_version"] == flatbnn.__version__ == importlib.metadata.version("flatbnn"), run["meta"]
print(f"wheel_check: digits accuracy {acc:.4f} (train and flatbnn-eval agree)")
EOF

# the commands of scripts/ ship in the package (flatbnn/tools/)
flatbnn-analyze --help > /dev/null && "$V" -m flatbnn.tools.reproduce_fsam_toy --help > /dev/null ||
  fail "flatbnn/tools/ is not in the wheel"

# the shipped rows compose against the shipped configs; an installed package sweeps under the current directory
flatbnn-reproduce list > rows.txt && grep -q "^flatbnn_t2" rows.txt || fail "flatbnn-reproduce list: $(head -3 rows.txt)"
flatbnn-reproduce run fsam_fig4_train --scale smoke --dry-run > row.out 2>&1 || { cat row.out; fail "a row's dry run"; }
grep -q -- "-m flatbnn.train --multirun .*hydra.sweep.dir=$PWD/outputs/reproduce/fsam_fig4_train/smoke" row.out &&
  ls outputs/reproduce/fsam_fig4_train/smoke/.hydra_cells/cell/*.yaml > /dev/null || fail "a row's dry run: $(cat row.out)"

cd "$REPO"
[ "$(git status --porcelain)" = "$before" ] || fail "the check wrote into the checkout: $(git status --porcelain)"
echo "wheel_check: $(basename "$wheel") installed and ran outside the checkout in $((SECONDS - t0)) s"
