#!/usr/bin/env bash
# Issue 28 on a lent GPU machine: every CUDA path run for real, in phases that each fit one device call
# (10 minutes). The machine is bare and offline, so the call carries what it needs (git-ignored):
#   .corpora/*.xz      the shared corpora, xz-compressed (xz -T2 -6 -c ../shared/corpora/enwiki.jsonl; and
#                      tinyshakespeare.txt, which a CUDA test reads)
#   .corpora/gpt2/     GPT-2's ranks as a BPE directory (tiktoken can't download them offline)
#   .whl/              wheels the image lacks: datasets, dill, multiprocess, rustbpe (cp312); not regex:
#                      the image's transformers refuses to import beside requirements.txt's pinned one
#
#   bash bench/gpu_session.sh suite bpe_small        # then: bpe_big data step, then: train ddp sample
#   (hellaswag, after train: one HellaSwag eval of the 124M checkpoint, timed)
#   DEADLINE=560 bash bench/gpu_session.sh suite_cuda bpe_loop generate_b8 hellaswag_bench step_lillm \
#       hellaswag_scratch
#                                                    # issue 39's one call (15 minutes of device time in all)
#   (the limits sum to ~1,490 s: a normal run likely reaches the deadline in step_lillm; most needed first)
#
# Every step has its own time limit and goes on after a failure; its output goes to $OUT/log.txt and one
# line per step (rc, seconds) to $OUT/summary.txt, printed again at the end. No step starts or runs past
# DEADLINE seconds from the start. DRY_RUN=1 prints each step's command (the corpora and other files are made;
# no pip, no GPU), with every step taking its whole limit: what a slow run would skip.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 CORPORA_DIR=/tmp/corpora
CORPORA=/tmp/corpora
LOG=$OUT/log.txt
DEADLINE=${DEADLINE:-570}  # seconds: a device call ends at 600
DRY_RUN=${DRY_RUN:-}

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log it, never stop the script
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    if (( started + limit > DEADLINE )); then  # the call's own limit: keep the logs of what ran
        limit=$((DEADLINE - started))
        (( limit > 10 )) || { echo "=== $name: skipped, past the deadline" | tee -a "$OUT/summary.txt"; return; }
    fi
    echo "=== $name: $*" | tee -a "$LOG"
    [ -z "$DRY_RUN" ] || { SECONDS=$((started + limit)); return; }
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc $rc in $((SECONDS - started)) s" | tee -a "$LOG" "$OUT/summary.txt"
}

setup() {
    if [ ! -d /tmp/site ] && [ -z "$DRY_RUN" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    fi
    mkdir -p $CORPORA
    for packed in .corpora/*.xz; do
        local name=$CORPORA/$(basename "$packed" .xz)
        [ -f "$name" ] || xz -dc "$packed" > "$name"
    done
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$LOG"
    python3 -c "import torch, triton, datasets, pyarrow, rustbpe, tiktoken, transformers as t, regex
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'datasets',
      datasets.__version__, 'pyarrow', pyarrow.__version__, 'tiktoken', tiktoken.__version__,
      'transformers', t.__version__, 'regex', regex.__version__)" 2>&1 | tee -a "$LOG"
    lscpu | grep "Model name" | tee -a "$LOG"
    git log -1 --format="commit %h %s" 2>/dev/null | tee -a "$LOG"
}
export PYTHONPATH=/tmp/site

make_data() {  # the tokenizers and shards the training phases read (kept while the machine stays warm)
    [ -f data/enwiki_gpt2/meta.json ] || step prepare_gpt2 240 python3 prepare_data.py \
        --tokenizer .corpora/gpt2 --data $CORPORA/enwiki.jsonl --out data/enwiki_gpt2 --workers 16
    [ -f tokenizers/enwiki_v8191/tokenizer.json ] || step bpe_lillm 240 python3 train_bpe_gpu.py \
        -v 8191 -n 100000000 --data $CORPORA/enwiki.jsonl --out tokenizers/enwiki_v8191
    [ -f data/enwiki_lillm/meta.json ] || step prepare_lillm 240 python3 prepare_data.py \
        --tokenizer tokenizers/enwiki_v8191 --data $CORPORA/enwiki.jsonl --out data/enwiki_lillm --workers 16
}

make_hellaswag() {  # 10,042 examples in HellaSwag's format, made from enwiki as the tests make theirs
    [ -f /tmp/hellaswag_10042.jsonl ] && return
    python3 - > /tmp/hellaswag.jsonl <<'MAKE'
import json, random
rng = random.Random(0)
for line in open("/tmp/corpora/enwiki.jsonl"):
    text = json.loads(line)["text"]
    if len(text) < 400:
        continue
    context, ending = text[100:300], text[300:380]
    distractors = [" ".join(w[::-1] for w in ending.split(" ")), ending[::-1], "".join(rng.sample(ending, 80))]
    label = rng.randrange(4)
    print(json.dumps({"ctx": context, "endings": distractors[:label] + [ending] + distractors[label:],
                      "label": label}))
MAKE
    head -n 10042 /tmp/hellaswag.jsonl > /tmp/hellaswag_10042.jsonl
}

setup
for phase in "$@"; do
    case $phase in
    suite_cuda)  # the tests CI skips for want of a GPU (the interpreter's run in CI), at most 180 s
        step suite_cuda 180 python3 -m pytest -v -n 6 -p no:cacheprovider --timeout=170 --tb=short -rf \
            --durations=10 -k "cuda or nccl" ;;
    bpe_loop)  # the merge loop at V=65534 on 2^27 characters beside rustbpe, each kernel's time a merge made:
        # --max_batch 1 (one merge a round, the sequential path) and the default (8), issue 37
        [ -f $CORPORA/enwiki3.jsonl ] || cat $CORPORA/enwiki.jsonl{,,} > $CORPORA/enwiki3.jsonl
        step bpe_loop_batch1 150 python3 bench/bench_bpe_gpu.py --data $CORPORA/enwiki3.jsonl \
            -n 134217728 -v 65534 --repeats 1 --profile --max_batch 1
        step bpe_loop 200 python3 bench/bench_bpe_gpu.py --data $CORPORA/enwiki3.jsonl \
            -n 134217728 -v 65534 --repeats 1 --profile ;;
    hellaswag_bench)  # issue 36: examples a forward, 1 (the old path) against 32 and 64, the 124M shape
        step hellaswag_bench 150 python3 bench/bench_hellaswag.py config/gpt2_124m.py --device cuda \
            --examples 1000 --batches 1,32,64 --repeats 3 ;;
    hellaswag_scratch)  # the 124M model's HellaSwag eval timed: --eval_only on a checkpoint of one step (the time
        # doesn't depend on the weights; --max_iters=0 trains nothing and evaluates nothing); with less without
        [ -f data/enwiki_small_gpt2/meta.json ] || { head -n 3000 $CORPORA/enwiki.jsonl > /tmp/enwiki_small.jsonl
            step prepare_small_gpt2 60 python3 prepare_data.py --tokenizer .corpora/gpt2 \
                --data /tmp/enwiki_small.jsonl --out data/enwiki_small_gpt2 --val_tokens=100000; }
        make_hellaswag
        scratch="config/gpt2_124m.py --dataset=data/enwiki_small_gpt2 --out_dir=out-hs --compile=False \
            --eval_iters=1 --batch_size=8 --total_batch_size=None --sample_prompt= \
            --hellaswag=/tmp/hellaswag_10042.jsonl"
        [ -f out-hs/ckpt.pt ] || step one_step_124m 90 python3 train.py $scratch --max_iters=1 \
            --hellaswag_interval=0
        step eval_without_hellaswag 60 python3 train.py $scratch --init_from=resume --eval_only=True \
            --hellaswag_interval=0
        step eval_with_hellaswag 200 python3 train.py $scratch --init_from=resume --eval_only=True ;;
    step_lillm)  # issue 36: MFU and how busy the GPU is; lilLM's step with and without CUDA graphs (compile's
        # reduce-overhead: was it the host?), 124M's plain loss beside the detached logits
        step step_lillm 120 python3 bench/bench_step.py config/lillm.py --losses detached \
            --modes default,reduce-overhead
        step step_gpt2 150 python3 bench/bench_step.py config/gpt2_124m.py ;;
    generate_b8)  # issue 36: the decode step in CUDA graphs (bf16 weights, as sample.py) beside the same graph
        # under autocast over float32 weights, the plain cache and the recompute, batch 1 and 8, the share of the
        # bandwidth limit; perf_hints says "skipping cudagraphs" if the graph is lost
        # (one process for both batch sizes: the compile caches stay warm)
        TORCH_LOGS=perf_hints step generate_b8 220 python3 bench/bench_model.py --part generate \
            --device cuda --dtype bfloat16 --presets lillm,gpt2_124m --new_tokens 256 --repeats 2 ;;
    suite)  # the CUDA tests that CI skips run here; the interpreter tests run compiled kernels
        # -v names each failure as it happens, even if the step runs out of time. Compiling on CUDA takes
        # ~40 s a run, so a test that trains 3 runs needs minutes: 90 s per test failed good tests here.
        step suite 420 python3 -m pytest -v -n 14 --dist loadfile -p no:cacheprovider --timeout=300 \
            --tb=short -rf --durations=10 ;;
    bpe_small)
        step bench_bpe_small 150 python3 bench/bench_bpe_gpu.py --data $CORPORA/enwiki.jsonl \
            -n 1048576 -v 1000 --count_reads --profile
        step multigpu_nccl_1 120 torchrun --standalone --nproc_per_node=1 train_bpe_multigpu.py \
            --data $CORPORA/enwiki.jsonl -n 1048576 -v 1000 --out /tmp/tok_multigpu ;;
    bpe_big)  # 2^27 characters: enwiki three times over (its 56.9M characters are fewer)
        [ -f $CORPORA/enwiki3.jsonl ] || cat $CORPORA/enwiki.jsonl{,,} > $CORPORA/enwiki3.jsonl
        step bench_bpe_big 300 python3 bench/bench_bpe_gpu.py --data $CORPORA/enwiki3.jsonl \
            -n 134217728 -v 65534 --repeats 1 --profile
        step host_side 150 python3 bench/bench_bpe_gpu.py --data $CORPORA/enwiki.jsonl --host_side \
            -n 33554432 --repeats 1 ;;
    data) make_data ;;
    step)  # one step of each preset's model on random tokens: tokens/s, MFU, the profile's top kernels
        step step_gpt2 200 python3 bench/bench_step.py config/gpt2_124m.py --trace $OUT/trace_gpt2
        step step_lillm 150 python3 bench/bench_step.py config/lillm.py ;;
    train)
        make_data
        step train_gpt2 240 python3 train.py config/gpt2_124m.py --dataset=data/enwiki_gpt2 \
            --out_dir=out-gpt2 --max_iters=120 --lr_decay_iters=120 --warmup_iters=20 --eval_interval=60 \
            --eval_iters=8 --hellaswag_interval=0  # the preset's 250 is no multiple of 60: refused
        step train_lillm 200 python3 train.py config/lillm.py --dataset=data/enwiki_lillm \
            --out_dir=out-lillm --max_iters=200 --lr_decay_iters=200 --warmup_iters=20 --eval_interval=100 \
            --eval_iters=20 ;;
    ddp)  # torchrun with NCCL: a run, its resume, and SIGTERM during a step (it saves and exits 0)
        make_data
        small="config/lillm.py --dataset=data/enwiki_lillm --total_batch_size=131072 --eval_iters=4"
        step ddp_first 150 torchrun --standalone --nproc_per_node=1 train.py $small --out_dir=out-ddp \
            --max_iters=20 --eval_interval=10
        step ddp_resume 120 torchrun --standalone --nproc_per_node=1 train.py $small --out_dir=out-ddp \
            --max_iters=30 --eval_interval=10 --init_from=resume
        [ -z "$DRY_RUN" ] || continue  # the SIGTERM drill is no step: nothing to print
        python3 train.py $small --out_dir=out-term --max_iters=100000 --eval_interval=1000 \
            > /tmp/term.log 2>&1 &
        pid=$!
        for _ in $(seq 240); do  # until step 30 is logged: the SIGTERM then lands inside a step
            grep -q "^iter 30" /tmp/term.log || ! kill -0 $pid 2>/dev/null && break
            sleep 1
        done
        kill -TERM $pid
        wait $pid
        echo "=== sigterm: rc $? (0 expected)" | tee -a "$LOG" "$OUT/summary.txt"
        tail -5 /tmp/term.log | tee -a "$LOG"
        ls -la out-term | tee -a "$LOG" ;;
    hellaswag)  # one HellaSwag eval of the 124M checkpoint (after train): 10,042 examples in HellaSwag's format,
        # made from enwiki as the tests make theirs (the Hub is out of reach), scored with --eval_only
        make_hellaswag
        step hellaswag_eval 300 python3 train.py config/gpt2_124m.py --dataset=data/enwiki_gpt2 \
            --out_dir=out-gpt2 --init_from=resume --eval_only=True --eval_iters=8 \
            --hellaswag=/tmp/hellaswag_10042.jsonl ;;
    sample)
        step sample_gpt2 120 python3 sample.py --out_dir=out-gpt2 --max_new_tokens=256 \
            --start="The history of"
        for run in "1 256" "1 1024" "8 256"; do
            read -r rows new_tokens <<< "$run"
            step generate_b${rows}_$new_tokens 150 python3 bench/bench_model.py --part generate \
                --device cuda --dtype bfloat16 --presets lillm,gpt2_124m --new_tokens $new_tokens \
                --batch_size $rows
        done ;;
    *) echo "unknown phase $phase" ;;
    esac
done
echo "--- summary"
cat "$OUT/summary.txt"
