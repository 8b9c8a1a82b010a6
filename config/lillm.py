# lilLM: the 39.6M-parameter Llama-style model (model.py's GPTConfig defaults) on FineWeb, with our own BPE
# tokenizer of 8192 ids (8191 merges and bytes, plus <|endoftext|>). train.py's defaults are this recipe, but
# for out_dir, dataset, hellaswag_interval, sample_prompt, always_save_checkpoint and milestones.
# The tokenizer and the data (the whole sample-10BT is ~10B tokens; --max_tokens limits it):
#   python train_bpe_cpu.py -v 8191 -n 1000000000
#   python prepare_data.py --tokenizer tokenizers/<the directory it printed> --data fineweb --out data/fineweb_lillm
# Train on 8 GPUs (one GPU works too: it accumulates 8x more micro-steps for the same batch):
#   torchrun --standalone --nproc_per_node=8 train.py config/lillm.py

out_dir = "out-lillm"
dataset = "data/fineweb_lillm"
eval_interval = 1000
eval_iters = 100  # x 64 x 512 tokens: 3.3M val tokens per estimate, whatever the number of GPUs
log_interval = 10
hellaswag_interval = 1000  # HellaSwag at every eval (the Hub's; offline: a note)
sample_prompt = 'The meaning of life is'  # a sample at every eval
always_save_checkpoint = True  # lots of data, no overfitting: the latest is what a resume wants
milestones = [10_000, 20_000]  # copies to keep, beside ckpt.pt (the SLURM seed kept 10k, 20k, then every 50k)

total_batch_size = 524_288  # 2^19 tokens per step (GPT-3's batch for models this small): 16 micro-steps on 1 GPU
# per GPU: 32k tokens, ~9 GB. At 32 an H100 waited on Python: busy 17 of a micro-step's 30 ms (RESULTS)
batch_size = 64
block_size = 512

n_layer = 12
n_head = 16
n_kv_head = 8
n_embd = 512
dropout = 0.0  # one pass over the data: nothing to regularize

learning_rate = 1e-3  # smaller models take higher rates than GPT-2's 6e-4
min_lr = 1e-4
max_iters = 20_000  # 10.5B tokens: about one pass over FineWeb's sample-10BT
lr_decay_iters = 20_000
warmup_iters = 700
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0
