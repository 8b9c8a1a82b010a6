# A GPT-2-124M-size model with the Llama-style blocks of model.py (12 layers, 768 wide, 12 heads, plain
# multi-head attention), on FineWeb tokenized with GPT-2's tokenizer: the size nanoGPT, llm.c and
# build-nanogpt train, to compare speed (MFU) and loss with them.
# The data (tiktoken downloads the gpt2 ranks once):
#   python prepare_data.py --tokenizer gpt2 --data fineweb --out data/fineweb_gpt2
# Train:
#   torchrun --standalone --nproc_per_node=8 train.py config/gpt2_124m.py

out_dir = "out-gpt2-124m"
dataset = "data/fineweb_gpt2"
eval_interval = 250
eval_iters = 20  # x 64 x 1024 tokens: 1.3M val tokens per estimate, shared out among the GPUs
log_interval = 10
hellaswag_interval = 250  # HellaSwag at every eval (the Hub's; offline: a note)
sample_prompt = "Hello, I'm a language model,"  # a sample at every eval
always_save_checkpoint = True
milestones = []

# 16 GPUs (2 nodes) need --batch_size=32: 64 x 1024 tokens on each would make a step of 2^20
total_batch_size = 524_288  # 2^19 tokens, ~0.5M as GPT-3 Small: 8 micro-steps on 1 GPU
batch_size = 64  # per GPU, fits 80 GB in bfloat16; lower it on smaller GPUs (accumulation makes up for it)
block_size = 1024

vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 128: faster matmuls, the extra ids never occur
n_layer = 12
n_head = 12
n_kv_head = 12  # no grouping: the same attention as GPT-2
n_embd = 768
dropout = 0.0

learning_rate = 6e-4  # GPT-3 Small's
min_lr = 6e-5
max_iters = 19_073  # 10B tokens / 2^19, one pass over sample-10BT (build-nanogpt's schedule)
lr_decay_iters = 19_073
warmup_iters = 715
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
