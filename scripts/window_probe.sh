#!/usr/bin/env bash
# The small-net GPU step, probed (issue 52 item 3): why did the graphed bSAM m=8 MLP step take 24.9 ms in the
# H100 window of 2026-11-27 (two campaign processes, loader cpu)? Two epochs of MNIST each (the first holds the
# capture), img/s of the second, meta.cuda_graph (replays / eager steps / reasons), one vs two processes, the
# host loader vs dataset.loader=device, graphed vs eager, bSAM / VOGN / SGD. Summary -> $OUT/probe.json.
#   BUDGET_S=230 bash scripts/window_probe.sh MNIST_ROOT OUT [DEVICE=cuda] [EPOCHS=2]   (on the device, before the window)
#   SET=threads ...: two side-by-side host-loader jobs with 8 threads each (window 6's open question), ~40 s
#   SET=differences ...: only what window 5's probe left open (two processes with the host loader, with and
#   without CUDA MPS and with per-process thread caps; progress + per-epoch evaluation), ~100 s
set -u
ROOT=$1; OUT=$2; DEV=${3:-cuda}; EP=${4:-2}
W=$(mktemp -d /tmp/probe.XXXX)
MLP=(dataset=mnist dataset.root=$ROOT model=mlp "model.hidden=[500,300]" model.activation=relu dataset.augment=none
     trainer.batch_size=200 trainer.epochs=$EP trainer.eval_every=0 trainer.progress=false trainer.reliability_diagram=false
     trainer.device=$DEV scheduler=cosine scheduler.warmup_epochs=0 scheduler.final_factor=0.0)
BSAM=(method=bsam flatness=none method.lr=0.1 method.prior_precision=40 method.rho=0.01 method.m=8 method.damping=0.1 method.num_samples=32)
VOGN=(method=vogn flatness=none method.lr=0.1 method.prior_precision=25 method.m=8 method.damping=0.1 method.num_samples=32)
SGD=(method=map optimizer=sgd flatness=none optimizer.lr=0.03 optimizer.momentum=0.9)
run() {  # name, overrides... (each within what is left of the probe's BUDGET_S, at most 75 s)
  local name=$1; shift
  local left=$(( DEADLINE - $(date +%s) )); (( left > 75 )) && left=75
  (( left < 10 )) && { echo "$name skipped: the probe's budget is spent"; return; }
  timeout $left python3 train.py "${MLP[@]}" "$@" hydra.run.dir=$W/$name > $W/$name.out 2>&1; echo "$name rc $?"
}
t0=$(date +%s); DEADLINE=$(( t0 + ${BUDGET_S:-230} ))
if [[ ${SET:-all} == threads ]]; then
  # window 6's open question (~40 s): is the 25 ms of two side-by-side host-loader jobs their threads? The same
  # pair as bsam_graph_pair_cpu_*, each with 8 threads (what campaign.job_env now gives 2 jobs on 16 cores)
  OMP_NUM_THREADS=8 run bsam_graph_pair_omp8_a "${BSAM[@]}" trainer.cuda_graph=true seed=1 &
  OMP_NUM_THREADS=8 run bsam_graph_pair_omp8_b "${BSAM[@]}" trainer.cuda_graph=true seed=2 &
  wait
  SKIP_ALL=1
elif [[ ${SET:-all} == differences ]]; then
  # window 5 ran its pair with dataset.loader=device only; window 4's and 5's slow campaign jobs had the host
  # loader, two processes, each with torch's default threads (all cores), and CUDA MPS
  run bsam_graph_pair_cpu_a "${BSAM[@]}" trainer.cuda_graph=true seed=1 &
  run bsam_graph_pair_cpu_b "${BSAM[@]}" trainer.cuda_graph=true seed=2 &
  wait
  run bsam_graph_progress_eval "${BSAM[@]}" trainer.cuda_graph=true trainer.progress=true trainer.eval_every=1
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
    run bsam_graph_mps_cpu_a "${BSAM[@]}" trainer.cuda_graph=true seed=1 &
    run bsam_graph_mps_cpu_b "${BSAM[@]}" trainer.cuda_graph=true seed=2 &
    wait
    OMP_NUM_THREADS=4 run bsam_graph_mps_omp4_a "${BSAM[@]}" trainer.cuda_graph=true seed=1 &
    OMP_NUM_THREADS=4 run bsam_graph_mps_omp4_b "${BSAM[@]}" trainer.cuda_graph=true seed=2 &
    wait; echo quit | nvidia-cuda-mps-control
  else echo "no CUDA MPS here"; fi
  SKIP_ALL=1
fi
[[ -n ${SKIP_ALL:-} ]] || {
run bsam_graph_cpuloader "${BSAM[@]}" trainer.cuda_graph=true
run bsam_graph_devloader "${BSAM[@]}" trainer.cuda_graph=true dataset.loader=device
run bsam_eager_devloader "${BSAM[@]}" dataset.loader=device
run sgd_graph_devloader "${SGD[@]}" trainer.cuda_graph=true dataset.loader=device
run vogn_graph_devloader "${VOGN[@]}" trainer.cuda_graph=true dataset.loader=device
# two processes side by side, as the window's campaign ran them (no MPS)
run bsam_graph_pair_a "${BSAM[@]}" trainer.cuda_graph=true dataset.loader=device seed=1 &
run bsam_graph_pair_b "${BSAM[@]}" trainer.cuda_graph=true dataset.loader=device seed=2 &
wait
# what the window's campaign does and the runs above do not (window 5, 2026-11-28: its graphed LeNet-5 SGD jobs ran at
# 25 ms a step, as window 4's graphed bSAM MLP jobs; these runs at 0.2-3 ms): progress bars into a file and a
# per-epoch evaluation, then two processes under CUDA MPS (the campaign starts it for 2 processes on a GPU)
run bsam_graph_progress_eval "${BSAM[@]}" trainer.cuda_graph=true trainer.progress=true trainer.eval_every=1
if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
  run bsam_graph_mps_a "${BSAM[@]}" trainer.cuda_graph=true seed=1 &
  run bsam_graph_mps_b "${BSAM[@]}" trainer.cuda_graph=true seed=2 &
  wait; echo quit | nvidia-cuda-mps-control
else echo "no CUDA MPS here"; fi
}
echo "probe: $(( $(date +%s) - t0 )) s"
python3 - "$W" "$OUT/probe.json" <<'EOF'
import json, sys
from pathlib import Path
w, out = Path(sys.argv[1]), Path(sys.argv[2])
summary = {}
for o in sorted(w.glob("*.out")):
    d, s = w / o.stem, {}
    m = d / "metrics.jsonl"
    if m.exists():
        s["epochs"] = [{k: r.get(k) for k in ("epoch", "train/loss", "train/images_per_s", "train/seconds")}
                       for r in map(json.loads, m.read_text().splitlines()) if "train/loss" in r]
    r = d / "results.json"
    if r.exists():
        res = json.loads(r.read_text())
        s["cuda_graph"] = res.get("meta", {}).get("cuda_graph")
        s["test"] = {k: v for k, v in res.items() if k.startswith("test/")}
    s["log_head"], s["log_tail"] = o.read_text()[:3000], o.read_text()[-2000:]
    summary[d.name] = s
    ips = [e["train/images_per_s"] for e in s.get("epochs", [])]
    print(d.name, "img/s per epoch", [round(x) for x in ips], "ms/step", [round(200e3 / x, 2) for x in ips if x],
          "graph", s.get("cuda_graph"))
out.write_text(json.dumps(summary, indent=1))
EOF
