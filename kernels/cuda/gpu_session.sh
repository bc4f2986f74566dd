#!/usr/bin/env bash
# One GPU session's work, in the phases a lease's calls can hold (each well under 10 minutes):
#   bash kernels/cuda/gpu_session.sh tests     the GPU tests (-m gpu) and the compile checks, then the goal case
#   bash kernels/cuda/gpu_session.sh bench     bench-verify over V × γ × B × dtype (and with top-p)
#   bash kernels/cuda/gpu_session.sh sanitize  compute-sanitizer (memcheck, racecheck, synccheck, initcheck) on small cases
#   bash kernels/cuda/gpu_session.sh e2e       end to end: random-weight models of the embedded pair's shapes
#   bash kernels/cuda/gpu_session.sh steps     issue 40: graphed steps (tests, per-step costs of the embedded shapes
#                                              and a 7B-class target, verification as one graph, compare end to end)
# Outputs go to $OUT (the device tool's folder) or ./gpu-out. Wheels the GPU image lacks (gguf, soundfile,
# transformers at our pin) travel in .whl/; the Qwen tokenizer and the pair's configs in .gpu/.
set -uo pipefail
cd "$(dirname "$0")/../.."  # the repository root
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi

versions() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  python3 -c "import torch, cupy, transformers, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, \
'cuda', torch.version.cuda, '| cupy', cupy.__version__, '| transformers', transformers.__version__, '|', \
torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  nvcc --version | tail -2
}

make_models() {  # random-weight HF directories of the embedded pair's shapes, with the Qwen tokenizer
  [ -f /tmp/models/target/config.json ] && return 0
  gunzip -c .gpu/tok/tokenizer.json.gz > /tmp/tokenizer.json
  python3 - <<'EOF'
import json, shutil, torch
from transformers import Qwen2Config, Qwen2ForCausalLM
for seed, role in ((1, "draft"), (0, "target")):
    cfg = Qwen2Config.from_dict(json.load(open(f".gpu/config-{role}.json")))
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(f"/tmp/models/{role}")
    shutil.copy("/tmp/tokenizer.json", f"/tmp/models/{role}/tokenizer.json")
    for f in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f".gpu/tok/{f}", f"/tmp/models/{role}/{f}")
    print(role, sum(p.numel() for p in model.parameters()) / 1e9, "G parameters")
EOF
}

case "${1:-tests}" in
tests)
  versions 2>&1 | tee "$out/versions.txt"
  timeout 480 python3 -m pytest tests/test_kernels.py -q -rs -m gpu --durations=12 -p no:cacheprovider 2>&1 \
    | tee "$out/gpu-tests.log"
  timeout 60 python3 -m pytest tests/test_kernels.py -q -rs -k "compile or without_cupy or plan_fills" \
    -p no:cacheprovider 2>&1 | tail -5 | tee -a "$out/gpu-tests.log"
  timeout 60 python3 -m specviz bench-verify --vocab 151936 --gamma 5 --batch 1 --dtype fp32 --iters 200 \
    --json "$out/bench-verify-goal.json" 2>&1 | tee "$out/bench-verify-goal.txt"
  timeout 60 python3 -m specviz bench-verify --vocab 151936 --gamma 5 --batch 1 8 --dtype fp32 bf16 --top-p 0.9 \
    --iters 100 --json "$out/bench-verify-topp.json" 2>&1 | tail -22 | tee "$out/bench-verify-topp.txt"
  ;;
bench)
  versions 2>&1 | tee "$out/versions.txt"
  timeout 330 python3 -m specviz bench-verify --dtype fp16 bf16 fp32 --vocab 51865 151936 256000 --gamma 1 5 10 20 \
    --batch 1 8 --iters 100 --json "$out/bench-verify.json" 2>&1 | tee "$out/bench-verify.txt"
  timeout 60 python3 -m specviz bench-verify --vocab 151936 --gamma 5 --batch 1 8 --dtype fp32 --top-p 0.9 \
    --iters 100 --json "$out/bench-verify-topp.json" 2>&1 | tail -12 | tee "$out/bench-verify-topp.txt"
  ;;
sanitize)
  cat > /tmp/sanitize_case.py <<'EOF'
import torch
from specviz.verify import project_kernels
k = project_kernels()
g = torch.Generator(device="cuda").manual_seed(0)
for mode, top_p in (("exact", 1.0), ("sigmoid", 1.0), ("exact", 0.9), ("sigmoid", 0.5)):
    for V, B, gamma in ((1000, 2, 3), (5003, 3, 5)):
        tl = 2 * torch.randn(B, gamma + 1, V, generator=g, device="cuda")
        dl = tl[:, :gamma] + torch.randn(B, gamma, V, generator=g, device="cuda")
        tokens = torch.randint(0, V, (B, gamma), generator=g, device="cuda")
        u = torch.rand(B, gamma, generator=g, device="cuda"); ur = torch.rand(B, generator=g, device="cuda")
        out = k.verify_cuda(mode, tokens, dl, tl, u, ur, scale=1.0, sigmoid_alpha=-8.0, sigmoid_beta=8.0, top_p=top_p)
        torch.cuda.synchronize()
        print(mode, top_p, V, B, gamma, {n: v.tolist() for n, v in out.items() if n in ("n_accepted", "next_token")})
EOF
  for tool in memcheck racecheck synccheck initcheck; do
    echo "== compute-sanitizer --tool $tool"
    PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 100 compute-sanitizer --tool $tool --print-limit 20 python3 /tmp/sanitize_case.py 2>&1 | tail -8
  done | tee "$out/sanitizer.txt"
  ;;
e2e)
  versions 2>&1 | tee "$out/versions.txt"
  make_models
  # Sampled (the kernels verify sampled runs): the kernels (auto) and the torch path, same models and seed.
  for backend in auto torch; do
    timeout 200 python3 -m specviz compare --target /tmp/models/target --draft /tmp/models/draft --device cuda \
      --draft-kind model --gamma-policy constant --gamma 5 --temperature 0.8 --max-new-tokens 96 --repeat 2 \
      --verify-backend $backend --json "$out/e2e-$backend.json" 2>&1 | grep -v "it/s\]\|run/s" | tail -12 \
      | tee -a "$out/e2e.txt"
  done
  ;;
steps)
  # Everything lands in $out/steps/ and is packed into $out/steps.tgz after each part (a call returns at most
  # 8 files); parts run in order of what the issue's goals need, each under its own timeout.
  o="$out/steps"; mkdir -p "$o"
  pack() { tar czf "$out/steps.tgz" -C "$o" . ; }
  versions 2>&1 | tee "$o/versions.txt"
  timeout 240 python3 -m specviz.bench.gpu_steps --reps 30 --json "$o/gpu-steps.json" \
    --modes ${STEP_MODES:-graphs graphs-cublas graphs-matmul} \
    --profile draft/graphs draft/graphs-cublas target/graphs target/graphs-cublas target7b/graphs target7b/graphs-cublas \
    --configs draft=.gpu/config-draft.json target=.gpu/config-target.json target7b=.gpu/config-target7b.json \
    2>&1 | grep -v Warning | tee "$o/gpu-steps.txt"; pack
  timeout 200 python3 -m pytest tests/test_graphed.py tests/test_sampling.py -q -rs -m gpu -p no:cacheprovider 2>&1 | tail -25 | tee "$o/gpu-tests-graphed.log"; pack
  timeout 60 python3 kernels/cuda/graph_check.py --json "$o/verify-graph.json" 2>&1 | tail -30 | tee "$o/verify-graph.txt"; pack
  make_models 2>&1 | tee "$o/models.txt"
  for linear in auto; do  # end to end on the default step path (the iteration's split in the JSON)
    SPECVIZ_STEP_LINEAR=$linear timeout 150 python3 -m specviz compare --target /tmp/models/target \
      --draft /tmp/models/draft --device cuda --draft-kind model --gamma-policy constant --gamma 5 --temperature 0.8 \
      --max-new-tokens 96 --repeat 2 --modes exact --json "$o/e2e-graphs-$linear.json" 2>&1 \
      | grep -v "it/s\]\|run/s" | tail -14 | tee -a "$o/e2e.txt"
    pack
    SPECVIZ_STEP_LINEAR=$linear timeout 100 python3 -m specviz compare --target /tmp/models/target \
      --draft /tmp/models/draft --device cuda --draft-kind model --gamma-policy constant --gamma 4 --temperature 0.8 \
      --max-new-tokens 64 --num-sequences 8 --batch-size 8 --modes exact --json "$o/e2e-bass8-$linear.json" 2>&1 \
      | grep -v "it/s\]\|run/s" | tail -14 | tee -a "$o/e2e.txt"
    pack
  done
  timeout 60 python3 -m pytest tests/test_kernels.py -q -rs -m gpu -k "graph or first_token or no_other_sync" \
    -p no:cacheprovider 2>&1 | tail -25 | tee "$o/gpu-tests-kernels.log"; pack
  ;;
esac
