#!/usr/bin/env bash
# One device call, several steps: `bash tools/gpu_session.sh STEP...`; each step's log goes to $OUT/STEP.log
# and a one-line status to stdout. Steps: see the case below (tests, pytests (PYTESTS=the test files,
# required; PYTESTS_TIMEOUT), opstests, gputests and its two halves graphtest / fastpathtests, gemmmoetests,
# moetests, attn, gemm, fla, moe, small, the sweeps (moesweepdecode: the decode MoE block's tiles; moeprofile:
# its launches' times at MOE_TOKENS under three routings), ab
# (AB_ENV=NAME=A,B [AB_PACKAGE=...]: tools/ab_step), bench35/27[full] (BENCH_ARGS, BENCH_TAG: extra flags
# and a suffix of the JSON's name), bench35/27plain (without the decode lookahead), profile35/27, prefilldetail,
# engine27/35, timeline27/35 (PROFILE_GC=default|freeze|off, PROFILE_BATCH, PROFILE_ARGS), gtimeline27/35
# (tools/graph_timeline: each kernel's marginal time inside the decode graph; PROFILE_BATCH,
# GTIMELINE_ARGS=--engine: the Engine's own graphs too), hostround27/35
# (HOSTROUND_BATCH), mtpdiag (tools/mtp_diagnose: where MTP parts from plain decoding; DIAG_ARGS), skinny,
# chain (GEMV tiles timed back to back, as in the graph; chain8: eight rows, CHAIN_SHAPES), graphlaunch,
# pdlprofile, pdloff8, chunk8k, interfere27/35 (bench --interference IF_TOKENS: streams' gaps while a long
# prompt arrives, pacing on and off; IF_ARGS),
# start27: a synthetic full-size 27B artifact loaded by bench), multiturn27/35 (a 10-turn agent conversation
# through the context cache, 2,048 new tokens a turn; MT_TIMEOUT, MT_ARGS), image27/35 (the vision tower and
# one-image TTFT at 448^2, 1024^2, 2048^2; IMAGE_TIMEOUT, IMAGE_ARGS), context27/35 (the long-context decode at
# 32k/128k/256k, B=1 and 8, each context's rows sharing one prefilled prompt, and a 128k prefill; CTX_TIMEOUT,
# CTX_ARGS: extra flags, later ones win, e.g. --context 262144 --batch 1,4), serve27/35 (`ninfer serve --synthetic`
# on loopback under `ninfer bench --server` at 1, 4, 8 streams, after the same workload through the Engine
# in-process; $OUT/serve27.json holds both and the gateway's added TTFT/TPOT; SERVE_PROMPT, SERVE_TOKENS,
# SERVE_REQUESTS, SERVE_CONCURRENCY, SERVE_READY_S, SERVE_TIMEOUT, SERVE_PORT; SERVE_ARGS: Engine flags for both
# runs, e.g. --kernels reference or --prefix-cache on), servetiny (the same harness on the tiny package),
# servetimeline27/35 (the in-process half under tools/serving_timeline: every Engine unit's time, the GC
# pauses and Triton compiles inside them; SERVE_CONCURRENCY, SERVE_REQUESTS, TL_TIMEOUT, TL_ARGS),
# visionprof (tools/vision_profile: the tower's kernels for one image; VP_ARGS), prefattn (tools/prefill_attention_probe: our Triton paged prefill attention at several launch
# shapes against the SDPA path; PA_ARGS), prefillhost27/35 (tools/prefill_host: one prefill chunk's enqueue, device and wall time, and its cProfile;
# PH_ARGS, e.g. --tokens 64,1024 --context 0).
# mtpsweep27/35 (`--speculative SWEEP_SPECS` at SWEEP_BATCH, default off,mtp:1,...,mtp:4: one bench process over
# one set of weights, a JSON line per backend; SWEEP_ARGS, e.g. --draft-vocab 32768; SWEEP_TAG names the file),
# knownsweep27/35 (the same with KNOWN, default known:1@1.9,known:2@2.4,known:3@2.8, at B = 1: the per-stream
# speed at the published acceptance).
# LOG_TAG: a suffix of the step's log and JSON names (two invocations of one step in one call, e.g. with
# IF_ARGS / TL_ARGS="--prefill-graph-tokens 0" and without).
# Each call is cut at 10 minutes: put the step that must finish first. The device returns at most 8 files:
# every step's log and JSON go to a work folder, packed after each step into $OUT/results.tgz (what a cut
# call finished comes back). TRITON_CACHE_DIR defaults to the ignored .tcache/, which a warm machine keeps
# between calls, so a second call on it compiles nothing twice.
# Carry .whl (tools/device_wheels.sh: fla-core, llguidance and the server's fastapi/uvicorn/pydantic/orjson
# stack); the image lacks them. Never installs anything but the carried wheels.
set -u -o pipefail  # a step's status is its command's, not its summary filter's
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}"
# invocations of one device call (one $OUT) share the work folder and the pack
RESULTS=${OUT:-/tmp/out}; OUT=/tmp/gpu_session.$(echo "$RESULTS" | md5sum | cut -c1-12); mkdir -p "$RESULTS" "$OUT"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/.tcache/triton}; mkdir -p "$TRITON_CACHE_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# tests import `tools/` as `ninfer_tools` (setup.py's package_dir); the image runs the tree uninstalled
mkdir -p /tmp/alias && ln -sfn "$PWD/tools" /tmp/alias/ninfer_tools
export PYTHONPATH=$PWD:/tmp/alias:$PYTHONPATH FLA_FLASH_QLA=0
BENCH="python3 -m ninfer bench --json"
pack() { tar czf "$RESULTS/results.tgz.tmp" -C "$OUT" . 2>/dev/null && mv "$RESULTS/results.tgz.tmp" "$RESULTS/results.tgz"; }
# a step cut by the call's limit still sends back its log as of the last few seconds
( while sleep 10; do pack; done ) &
PACKER=$!; trap 'kill $PACKER 2>/dev/null' EXIT

# serve_step PACKAGE TAG: the workload through an in-process Engine (TAG_engine.json), then `ninfer serve
# --synthetic PACKAGE` of the same settings in the background on loopback, /ready waited for (bounded), the
# load client at each concurrency (TAG_http.json), the server stopped (SIGTERM, then SIGKILL; its log
# TAG.server.log); the comparison to $OUT/TAG.json.
serve_step() {
  local pkg=$1 tag=$2 port=${SERVE_PORT:-8321} prompt=${SERVE_PROMPT:-1024} tokens=${SERVE_TOKENS:-128}
  local work="--concurrency ${SERVE_CONCURRENCY:-1,4,8} --prompt-tokens $prompt --max-tokens $tokens --requests ${SERVE_REQUESTS:-4}"
  python3 -c 'import fastapi, uvicorn, pydantic, orjson, llguidance; from importlib.metadata import version as v; print(*(f"{n} {v(n)}" for n in ("fastapi", "starlette", "uvicorn", "pydantic", "anyio", "h11", "typing_extensions")))' \
    || { echo "the server's packages are missing: carry .whl (bash tools/device_wheels.sh)"; return 1; }
  local rc=0 ready=0
  # the in-process half first: its figures survive a slow or cut HTTP half
  timeout "${SERVE_TIMEOUT:-240}" $BENCH --synthetic "$pkg" $work ${SERVE_ARGS:-} > "$OUT/${tag}_engine.json" || return $?
  touch "$OUT/.$tag.http.start"
  # the Engine settings of the in-process half: max_concurrency is the widest level there
  local widest; widest=$(echo "${SERVE_CONCURRENCY:-1,4,8}" | tr ',' '\n' | sort -n | tail -n 1)
  python3 -m ninfer serve --synthetic "$pkg" --port "$port" --max-concurrency "$widest" --max-context $((prompt + tokens)) \
    --prefix-cache off ${SERVE_ARGS:-} > "$OUT/$tag.server.log" 2>&1 &
  local pid=$!
  for _ in $(seq 1 "${SERVE_READY_S:-300}"); do
    kill -0 $pid 2>/dev/null || break
    if python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/ready', timeout=2)" 2>/dev/null; then ready=1; break; fi
    sleep 1
  done
  if [ $ready = 1 ]; then
    timeout "${SERVE_TIMEOUT:-240}" $BENCH --server "http://127.0.0.1:$port" $work > "$OUT/${tag}_http.json" || rc=$?
  else
    echo "the server was not ready within ${SERVE_READY_S:-300} s"; rc=1
  fi
  kill -TERM $pid 2>/dev/null
  for _ in $(seq 1 30); do kill -0 $pid 2>/dev/null || break; sleep 1; done
  kill -KILL $pid 2>/dev/null; wait $pid 2>/dev/null
  echo "--- server log (tail)"; tail -n 40 "$OUT/$tag.server.log"; echo "---"
  # kernels the server compiled that the in-process half had not (shapes only the served workload makes)
  echo "server compiled: $(find "$TRITON_CACHE_DIR" -mindepth 2 -name '*.json' ! -name '__grp__*' -newer "$OUT/.$tag.http.start" -printf '%f ' 2>/dev/null)"
  [ $rc = 0 ] || return $rc
  python3 -m ninfer.bench.serving compare "$OUT/${tag}_engine.json" "$OUT/${tag}_http.json" > "$OUT/$tag.json" \
    && python3 -c "import json,sys; [print(r) for r in json.load(open(sys.argv[1]))['gateway']]" "$OUT/$tag.json"
}
# Triton's cache holds a folder per compiled kernel: the count before and after a step says how many kernels
# the step compiled (a long step on a warm cache that still compiles points at new shapes or constants)
kernels() { find "$TRITON_CACHE_DIR" -mindepth 1 -maxdepth 1 -type d 2>/dev/null | wc -l; }
for step in "$@"; do
  t0=$(date +%s); k0=$(kernels); touch "$OUT/.$step.start"
  case $step in
    info) nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv; python3 -c 'import torch,triton;print(torch.__version__,triton.__version__)' ;;
    tests) timeout 420 python3 -m pytest -m gpu -p no:cacheprovider -rs tests/ops tests/sampling tests/model tests/gpu tests/engine tests/bench tests/targets tests/artifact ;;
    opstests) timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/ops ;;
    fla) timeout 300 python3 -m tools.kernel_bench.fla_prefill ;;
    moe) timeout 200 python3 -m tools.kernel_bench.fused_moe ;;
    small) timeout 200 python3 -m tools.kernel_bench.small_ops ;;
    attn) timeout 300 python3 -m pytest -m gpu -p no:cacheprovider -rs tests/ops/test_triton_attention_prologue.py && timeout 120 python3 -m tools.kernel_bench.attention_prologue ;;
    moesweep) timeout 200 python3 -m tools.kernel_bench.fused_moe --sweep ;;
    bench35) timeout ${BENCH_TIMEOUT:-400} $BENCH --synthetic qwen3_6_35b_a3b --batch 1,8 --decode-steps 32 --prefill-repeats 2 ${BENCH_ARGS:-} > "$OUT/bench35${BENCH_TAG:-}.json" ;;
    bench27) timeout ${BENCH_TIMEOUT:-500} $BENCH --synthetic qwen3_6_27b --batch 1,8 --decode-steps 32 --prefill-repeats 2 ${BENCH_ARGS:-} > "$OUT/bench27${BENCH_TAG:-}.json" ;;
    bench35plain) timeout ${BENCH_TIMEOUT:-400} $BENCH --synthetic qwen3_6_35b_a3b --batch 1,8 --decode-steps 32 --prefill-repeats 1 --no-decode-lookahead > "$OUT/bench35plain${LOG_TAG:-}.json" ;;
    bench27plain) timeout ${BENCH_TIMEOUT:-500} $BENCH --synthetic qwen3_6_27b --batch 1,8 --decode-steps 32 --prefill-repeats 1 --no-decode-lookahead > "$OUT/bench27plain${LOG_TAG:-}.json" ;;
    bench35full) timeout 500 $BENCH --synthetic qwen3_6_35b_a3b > "$OUT/bench35${LOG_TAG:-}.json" ;;
    bench27full) timeout 550 $BENCH --synthetic qwen3_6_27b > "$OUT/bench27${LOG_TAG:-}.json" ;;
    profile35) timeout 300 python3 -m tools.profile_step qwen3_6_35b_a3b ;;
    profile35pdloff) NINFER_PDL=0 timeout 200 python3 -m tools.profile_step qwen3_6_35b_a3b --batch 1,8 --prefill 256 ;;
    profile27) timeout 300 python3 -m tools.profile_step qwen3_6_27b ;;
    profile27ref) timeout 300 python3 -m tools.profile_step qwen3_6_27b --kernels reference --batch 1 --prefill 1024 ;;
    engine27) timeout 300 python3 -m tools.profile_engine qwen3_6_27b ;;
    engine35) timeout 300 python3 -m tools.profile_engine qwen3_6_35b_a3b ;;
    timeline27) timeout 150 python3 -m tools.profile_engine qwen3_6_27b --steps 24 --trace 0 --gc ${PROFILE_GC:-default} --batch ${PROFILE_BATCH:-1} ${PROFILE_ARGS:-} ;;
    timeline35) timeout 150 python3 -m tools.profile_engine qwen3_6_35b_a3b --steps 24 --trace 0 --gc ${PROFILE_GC:-default} --batch ${PROFILE_BATCH:-1} ${PROFILE_ARGS:-} ;;
    hostround27) timeout 150 python3 -m tools.host_round qwen3_6_27b ;;
    hostround35) timeout 150 python3 -m tools.host_round qwen3_6_35b_a3b --batch ${HOSTROUND_BATCH:-8} ;;
    chain) timeout 200 python3 -m tools.kernel_bench.skinny_chain ;;
    skinny) timeout 100 python3 -m pytest -m gpu -p no:cacheprovider -q tests/ops/test_triton_skinny_gemm.py -k real_shapes ;;
    skinnyconv) timeout 150 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/ops/test_triton_skinny_gemm.py -k "conv or real_shapes" ;;
    graphlaunch) timeout 120 python3 -m tools.kernel_bench.graph_launch ;;
    gemm) timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/ops/test_triton_skinny_gemm.py && timeout 200 python3 -m tools.kernel_bench.skinny_gemm ;;
    gemmsweep) timeout 200 python3 -m tools.kernel_bench.skinny_gemm --sweep ;;
    gemmsweep35) timeout 200 python3 -m tools.kernel_bench.skinny_gemm --sweep --variant 35b-a3b ;;
    pytests) timeout -s INT ${PYTESTS_TIMEOUT:-300} python3 -m pytest -m gpu -p no:cacheprovider -q -rs ${PYTESTS:?set PYTESTS} ;;
    mtpdiag) timeout -s INT ${DIAG_TIMEOUT:-240} python3 -m tools.mtp_diagnose ${DIAG_ARGS:-} ;;
    moetests) timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -q -rs tests/ops/test_triton_moe_decode.py tests/ops/test_triton_fused_moe.py ;;
    moesweepdecode) timeout 200 python3 -m tools.kernel_bench.moe_decode ;;
    moeprofile) NINFER_PDL=0 timeout 150 python3 -m tools.kernel_bench.moe_decode --profile --tokens ${MOE_TOKENS:-1 8} ;;
    chain8) timeout 150 python3 -m tools.kernel_bench.skinny_chain --rows 8 --shapes ${CHAIN_SHAPES:-5120x6144} ;;
    ab) timeout 300 python3 -m tools.ab_step ${AB_PACKAGE:-qwen3_6_35b_a3b} --env "$AB_ENV" --rounds 2 ;;
    gtimeline35) timeout 300 python3 -m tools.graph_timeline qwen3_6_35b_a3b --batch ${PROFILE_BATCH:-1,8} ${GTIMELINE_ARGS:-} ;;
    gtimeline27) timeout 300 python3 -m tools.graph_timeline qwen3_6_27b --batch ${PROFILE_BATCH:-1,8} ${GTIMELINE_ARGS:-} ;;
    ab27) timeout 300 python3 -m tools.ab_step qwen3_6_27b --env "$AB_ENV" --rounds 2 ;;
    gemmmoetests) timeout 200 python3 -m pytest -m gpu -p no:cacheprovider -rs tests/ops/test_triton_skinny_gemm.py tests/ops/test_triton_fused_moe.py ;;
    fastpathtests) timeout ${GPUTESTS_TIMEOUT:-300} python3 -m pytest -m gpu -p no:cacheprovider -v -rs tests/gpu/test_fast_path.py ${FASTPATH_K:+-k "$FASTPATH_K"} ;;
    graphtest) timeout 250 python3 -m pytest -m gpu -p no:cacheprovider -rs tests/gpu/test_engine_cuda.py ;;
    gputests) timeout ${GPUTESTS_TIMEOUT:-300} python3 -m pytest -m gpu -p no:cacheprovider -v -rs --durations=8 tests/gpu ;;
    prefilldetail) timeout 120 python3 -m tools.profile_step qwen3_6_27b --batch 1 --prefill 2048,8192 --prefill-detail;
        timeout 120 python3 -m tools.profile_step qwen3_6_35b_a3b --batch 1,8 --prefill 2048,8192 --prefill-detail ;;
    pdloff8) NINFER_PDL=0 timeout 200 $BENCH --synthetic qwen3_6_27b --batch 8 --decode-steps 32 --prefill-repeats 1 > "$OUT/pdloff8${LOG_TAG:-}.json" ;;
    start27) rm -f /tmp/q27.ninfer; timeout 300 python3 -m tools.synthetic_artifact qwen3_6_27b /tmp/q27.ninfer \
        && cat /tmp/q27.ninfer > /dev/null \
        && timeout 250 $BENCH /tmp/q27.ninfer --batch 1 --decode-steps 16 --prefill-repeats 1 > "$OUT/start27${LOG_TAG:-}.json" ;;
    pdlprofile) for p in 0 1; do NINFER_PDL=$p timeout 150 python3 -m tools.profile_step qwen3_6_27b --batch 1 --prefill 256; NINFER_PDL=$p timeout 150 python3 -m tools.profile_step qwen3_6_35b_a3b --batch 1 --prefill 256; done ;;
    chunk8k) timeout 300 $BENCH --synthetic qwen3_6_35b_a3b --batch 1 --decode-steps 16 --prefill-chunk 8192 > "$OUT/chunk8k35${LOG_TAG:-}.json" && timeout 300 $BENCH --synthetic qwen3_6_27b --batch 1 --decode-steps 16 --prefill-chunk 8192 > "$OUT/chunk8k27${LOG_TAG:-}.json" ;;
    interfere27) timeout ${IF_TIMEOUT:-300} $BENCH --synthetic qwen3_6_27b --interference ${IF_TOKENS:-32768} --streams 4 ${IF_ARGS:-} > "$OUT/interfere27${LOG_TAG:-}.json" ;;
    interfere35) timeout ${IF_TIMEOUT:-300} $BENCH --synthetic qwen3_6_35b_a3b --interference ${IF_TOKENS:-32768} --streams 4 ${IF_ARGS:-} > "$OUT/interfere35${LOG_TAG:-}.json" ;;
    multiturn27) timeout ${MT_TIMEOUT:-300} $BENCH --synthetic qwen3_6_27b --multi-turn 10 --turn-tokens 2048 ${MT_ARGS:-} > "$OUT/multiturn27${LOG_TAG:-}.json" ;;
    multiturn35) timeout ${MT_TIMEOUT:-300} $BENCH --synthetic qwen3_6_35b_a3b --multi-turn 10 --turn-tokens 2048 ${MT_ARGS:-} > "$OUT/multiturn35${LOG_TAG:-}.json" ;;
    image27) timeout ${IMAGE_TIMEOUT:-300} $BENCH --synthetic qwen3_6_27b --image 448x448,1024x1024,2048x2048 ${IMAGE_ARGS:-} > "$OUT/image27${LOG_TAG:-}.json" ;;
    image35) timeout ${IMAGE_TIMEOUT:-300} $BENCH --synthetic qwen3_6_35b_a3b --image 448x448,1024x1024,2048x2048 ${IMAGE_ARGS:-} > "$OUT/image35${LOG_TAG:-}.json" ;;
    context27) timeout ${CTX_TIMEOUT:-580} $BENCH --synthetic qwen3_6_27b --context 32768,131072,262144 --batch 1,8 --decode-steps 16 --prefill-tokens 131072 --prefill-repeats 1 ${CTX_ARGS:-} > "$OUT/context27${LOG_TAG:-}.json" ;;
    context35) timeout ${CTX_TIMEOUT:-580} $BENCH --synthetic qwen3_6_35b_a3b --context 32768,131072,262144 --batch 1,8 --decode-steps 16 --prefill-tokens 131072 --prefill-repeats 1 ${CTX_ARGS:-} > "$OUT/context35${LOG_TAG:-}.json" ;;
    mtpsweep27|mtpsweep35|knownsweep27|knownsweep35)
        pkg=qwen3_6_27b; [ "${step: -2}" = 35 ] && pkg=qwen3_6_35b_a3b
        if [ "${step:0:3}" = mtp ]; then specs=${SWEEP_SPECS:-off,mtp:1,mtp:2,mtp:3,mtp:4}; batch=${SWEEP_BATCH:-1,2,4,8}; extra=${SWEEP_ARGS:-}
        else specs=${KNOWN:-known:1@1.9,known:2@2.4,known:3@2.8}; batch=1; extra=; fi
        # one process, one set of weights, an Engine per backend; a JSON line per backend as it finishes
        timeout ${SWEEP_TIMEOUT:-400} $BENCH --synthetic $pkg --batch $batch --decode-steps 16 --prefill-tokens 1024 \
          --prefill-repeats 1 --speculative $specs $extra | tee "$OUT/${step}${SWEEP_TAG:-}.jsonl" \
          | python3 -c 'import json,sys; [print(r["settings"]["speculative"], [(d["batch"], d["ms_step"], d["tok_s"]) for d in r["decode"]], flush=True) for r in map(json.loads, sys.stdin)]' ;;
    servetimeline27|servetimeline35)
        pkg=qwen3_6_27b; [ "${step: -2}" = 35 ] && pkg=qwen3_6_35b_a3b
        timeout ${TL_TIMEOUT:-300} python3 -m tools.serving_timeline $pkg --concurrency ${SERVE_CONCURRENCY:-1,4} \
          --requests ${SERVE_REQUESTS:-2} --json "$OUT/$step${LOG_TAG:-}.json" ${TL_ARGS:-} ;;
    visionprof) timeout ${VP_TIMEOUT:-120} python3 -m tools.vision_profile ${VP_ARGS:-} ;;
    prefattn) timeout ${PA_TIMEOUT:-240} python3 -m tools.prefill_attention_probe ${PA_ARGS:-} --json "$OUT/prefattn.json" ;;
    prefillhost27) timeout 200 python3 -m tools.prefill_host qwen3_6_27b ${PH_ARGS:-} ;;
    prefillhost35) timeout 200 python3 -m tools.prefill_host qwen3_6_35b_a3b ${PH_ARGS:-} ;;
    serve27) serve_step qwen3_6_27b serve27 ;;
    serve35) serve_step qwen3_6_35b_a3b serve35 ;;
    servetiny) serve_step qwen3_6_tiny servetiny ;;
    *) echo "unknown step $step"; continue ;;
  esac > "$OUT/$step${LOG_TAG:-}.log" 2>&1
  rc=$?
  echo "== $step rc=$rc $(( $(date +%s) - t0 ))s, $(( $(kernels) - k0 )) kernels compiled :: $(tail -c 600 "$OUT/$step${LOG_TAG:-}.log" | tr '\n' ' ' | tail -c 400)"
  # which kernels the step compiled, by name (a step that compiles mid-measurement shows it here)
  find "$TRITON_CACHE_DIR" -mindepth 2 -name '*.json' ! -name '__grp__*' -newer "$OUT/.$step.start" -printf '%f\n' 2>/dev/null \
    | sed 's/\.json$//' | sort | uniq -c | sort -rn > "$OUT/$step.compiled"
  [ -s "$OUT/$step.compiled" ] && echo "   compiled: $(head -n 12 "$OUT/$step.compiled" | tr -s ' \n' ' ')"
  pack
done
