# The quickstart: a small model on the offline corpus (the Python standard library's source, tokenized with
# the 1000-token BPE of the quickstart's first command). A few minutes on 2 CPU cores (bench/RESULTS.md has
# the measured time); its samples read like Python. The data:
#   python train_bpe_cpu.py -v 1000 -n 1048576
#   python prepare_data.py --tokenizer tokenizers/stdlib_v1000
# Train, then sample:
#   python train.py config/quickstart.py
#   python sample.py --out_dir=out-quickstart --start="def "

out_dir = "out-quickstart"
dataset = "data/stdlib_v1000"
eval_interval = 250
eval_iters = 20
log_interval = 50
always_save_checkpoint = False  # keep the best val loss

total_batch_size = None  # no accumulation: one batch of batch_size x block_size tokens per step
batch_size = 16
block_size = 128  # tokens of context: about 370 characters of code

n_layer = 4
n_head = 4
n_kv_head = 2
n_embd = 128
dropout = 0.0  # 12.6M training tokens and 2000 steps of 2048: the model sees a third of them once

learning_rate = 2e-3  # tiny models take high rates
min_lr = 2e-4
max_iters = 2000
lr_decay_iters = 2000
warmup_iters = 100
beta2 = 0.99  # few tokens per step: a longer second-moment average is steadier
