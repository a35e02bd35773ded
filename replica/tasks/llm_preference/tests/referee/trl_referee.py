"""Referee for replica's DPO, ORPO and reward-model trainers: TRL itself (run with the project's .venv).

TRL is pinned at 0.13.0 (scripts/requirements-test.txt): the version AutoTrain 0.8.36 pins, whose
trainers replica's follow, and which runs unchanged on transformers 4.57.6 / peft 0.21.2. File
references below are to .venv/lib/python3.11/site-packages/trl/ of that version.

  make-model --out DIR [--seed S]
      A tiny random LlamaForCausalLM made by transformers (hidden 32, 2 layers, 4 heads over 2
      kv heads, intermediate 64, max_position_embeddings 128, untied, fp32, dropout 0; weights
      N(0, 0.1^2), norms around 1, drawn from --seed), save_pretrained(DIR) (safetensors), and
      its tokenizer saved into DIR with save_pretrained (tokenizer.json, tokenizer_config.json
      with the chat template in it, special_tokens_map.json): a byte-level BPE in the Llama 3
      layout that replica::text::Tokenizer reads (ByteLevel pre-tokenizer with the GPT-2 regex,
      BPE merges learned from the texts of make-data, ByteLevel decoder, post_processor
      TemplateProcessing "<s> $A", i.e. BOS with add_special_tokens), 384 ids: 0 <pad> (pad),
      1 <s> (bos), 2 <|im_end|> (eos), 3 <|im_start|>, then the 256 byte pieces and merges;
      PreTrainedTokenizerFast, model_max_length 128, padding_side right; chat template ChatML
      (replica/text/tests/chat_templates/chatml.jinja). vocab_size = len(tokenizer).
      Deterministic. Prints one JSON line.
      [--hidden 32] [--layers 2] [--heads 4] [--kv-heads 2] [--intermediate 64]
      [--max-positions 128] [--init-std 0.1]: another shape (bench/preference_vs_trl.sh uses
      --hidden 256 --layers 4 --heads 8 --kv-heads 4 --intermediate 688 --max-positions 256
      --init-std 0.02); --max-positions is also the tokenizer's model_max_length; --init-std the
      std of every weight but the norms (norms 1 + N(0, (2 init-std)^2)). The defaults give the
      model above, bit for bit.

  make-data --out FILE [--kind text|chat] [--rows N] [--repeat K]
      N (default 8) preference rows, JSONL, TRL's columns. text: {"prompt": str, "chosen":
      " " + str, "rejected": " " + str}; chat: {"prompt": [{"role": "user", ...}], "chosen":
      [{"role": "assistant", ...}], "rejected": [{"role": "assistant", ...}]} (TRL's
      conversational preference format, explicit prompt). Lengths vary so that the defaults
      below truncate prompts, completions and whole sequences, and drop reward rows. --repeat K
      (default 1): row i's prompt, chosen and rejected each join the K items i, i+1, .. (mod 12)
      with a space, for longer sequences (benchmarks).

  step --trainer dpo|orpo|reward --model DIR --data FILE --out FILE.safetensors
       [--peft [--lora-r 4] [--lora-alpha 8] [--target-modules all-linear]
               [--random-lora | --init-adapter DIR]]
       [--ref-model DIR] [--beta 0.1] [--max-prompt-length 12] [--max-completion-length 10]
       [--max-length L] [--batch 4] [--seed 42] [--check-train]
      TRL's trainer built as AutoTrain 0.8.36's train_clm_{dpo,orpo,reward}.py builds it
      (fp32 on CPU, dropout 0, gradient accumulation 1, no gradient checkpointing (it changes
      no number), lr 0), on the rows of FILE in file order; then ONE training step on the
      collated first B rows of the trainer's train_dataset: trainer.training_step (model.train(),
      compute_loss, backward) on trainer.data_collator(rows[:B]). --max-length is AutoTrain's
      block_size (default 20 for dpo/orpo, 80 for reward). --peft: LoraConfig(r, alpha,
      lora_dropout 0, bias none, task_type CAUSAL_LM (dpo, orpo) or SEQ_CLS (reward: `score`
      becomes modules_to_save), target_modules); its A matrices are drawn under
      torch.manual_seed(--seed), B = 0 (PEFT's init). --random-lora then draws every A, B (and the
      score copy) N(0, 0.1^2) from --seed + 1, so that step 1 is not the degenerate B = 0 one.
      --init-adapter DIR (instead of --random-lora) starts the trainable weights from the PEFT
      adapter directory DIR (adapter_config.json + adapter_model.safetensors in PEFT's layout,
      e.g. one replica wrote; for reward task_type SEQ_CLS, modules_to_save ["score"], holding
      base_model.model.score.weight): after TRL has built its PeftModel with the LoraConfig above,
      every tensor of the file is copied into its parameter with PEFT's set_peft_model_state_dict
      (the score head into the modules_to_save copy). It fails unless the file's keys are exactly
      the trainable parameters' adapter names (no tensor matching no parameter, no trainable
      parameter without a value), shapes agree, adapter_config.json's r, lora_alpha, use_rslora
      and task_type are the LoraConfig's (pass --lora-r/--lora-alpha to match), and then every
      trainable parameter equals its tensor exactly. This trains the same weights, with the same
      step-1 loss and gradients bit for bit, as handing TRL PeftModel.from_pretrained(base, DIR,
      is_trainable=True). DPO's reference stays the base with adapters disabled.
      DPO's reference: with --peft the same model with adapters disabled (TRL's null_ref_context);
      without, a frozen deep copy of the initial model (create_reference_model), or --ref-model
      DIR (AutoTrain's model_ref). Reward: AutoModelForSequenceClassification(num_labels 1,
      pad_token_id = tokenizer's), its `score` head drawn by transformers (N(0, 0.02^2)) under
      torch.manual_seed(--seed). --check-train also runs trainer.train() for one step (lr 0, a
      SequentialSampler) and fails unless its logged loss (rounded to 4 digits by Trainer),
      grad_norm and metrics equal the step's.
      FILE.safetensors:
          loss                 fp32 scalar: the loss of the step (what trainer.train() logs)
          grad.NAME            fp32: the gradient of each trainable parameter after backward
          init.NAME            fp32: its value before the step (LoRA A is random; the reward's
                               score head is new)
          metric.NAME          fp32 scalar: each metric TRL logs for the step ('/' kept), and
                               metric.grad_norm (Trainer's: L2 norm of all gradients, before clipping)
          rows                 int64 [B']: the data rows (0-based lines of FILE) in the batch
          ids.chosen.I, ids.rejected.I    int64 1-D, unpadded: the ids the policy was fed for
                               row I of the batch (I < B'), checked against a forward hook
          mask.chosen.I, mask.rejected.I  int64 1-D, same length: 1 at each token that is a
                               target of the log-prob sum (DPO, ORPO: token t is predicted by
                               the logits at t-1), or, for reward, at the token whose score is used
      NAME: with --peft the key of PEFT's adapter_model.safetensors (checked by saving it), e.g.
      base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight, and for reward
      base_model.model.score.weight (the modules_to_save copy); without, the HF state_dict name
      (model.layers.0.mlp.up_proj.weight, lm_head.weight, score.weight).
      Prints one JSON line: trainer, peft, loss, metrics, rows, trainable (count), trl.

  train --trainer dpo|orpo|reward --model DIR --data FILE --out DIR [same options as step]
        [--steps 20] [--lr 1e-3] [--world 2] [--batch 2]
      The same trainer trained under `accelerate launch --num_processes WORLD --multi_gpu
      --num_cpu_threads_per_process 1 --main_process_port 0` (accelerate 1.15): on a machine
      without GPUs that starts WORLD processes through torchrun and accelerate's PartialState
      takes them as MULTI_CPU with the gloo backend (DDP averages gradients). `--cpu
      --num_processes 2` would not: it uses the single-process launcher; accelerate's own
      MULTI_CPU launch needs mpirun and a hostfile. Per-device batch --batch, AdamW (adamw_torch,
      betas 0.9/0.999, eps 1e-8), constant lr, no warmup, weight_decay 0, max_grad_norm 1.0,
      seed 42, max_steps --steps, logging every step, no shuffling: Trainer's RandomSampler is
      replaced by a SequentialSampler and accelerate shards its batches (BatchSamplerShard,
      even_batches): with the data rows r_0.. of the train dataset (reward: those left after the
      length filter) cut into consecutive batches of --batch, step s gives global batch
      k = (s-1)*WORLD + rank (mod the number of batches per epoch) to each rank, and a last
      short batch is filled up from the epoch's first rows (8 rows, batch 2, world 2: step 1
      rank 0 rows 0,1, rank 1 rows 2,3; step 2 rows 4,5 / 6,7; then again; reward with rows
      0,1,2,3,5,6,7 kept: step 2 is 5,6 / 7,0). Writes into DIR: the trained adapter (or model)
      with trainer.save_model (AutoTrain's post_training_steps; with the tokenizer), DIR/init/
      (the trainable weights before step 1, save_pretrained), DIR/log.jsonl (rank 0's
      log_history entries, one per step: loss = the mean over ranks of the rank losses, rounded to
      4 digits; grad_norm of the averaged gradients; the trainer's metrics, which are rank 0's
      own batch only, TRL does not gather them; "rows": rank 0's data rows), DIR/log.rank1.jsonl
      the same for rank 1 (its own metrics and rows). Prints one JSON line (first and last log).
      With --init-adapter DIR0, DIR/init/ holds exactly DIR0's tensors.
      --timing (benchmarks): also DIR/timing.jsonl (rank 0) and DIR/timing.rank1.jsonl, one line
      per step: {"step", "t_begin", "t_end", "tokens"}: time.perf_counter() at the Trainer's
      on_step_begin and on_step_end callbacks, and the tokens of the rank's batch that step
      (chosen + rejected sequences as the model is fed them, padding excluded: DPO each row
      min(prompt + completion, max_length), ORPO and reward the attention masks' sums).

  check-load --trainer dpo|orpo|reward --final DIR [--peft --base BASE]
      Whether the final/ directory replica wrote loads in the real stack, exactly:
      --peft: the base from BASE (AutoModelForCausalLM, or for reward
      AutoModelForSequenceClassification with num_labels 1 and config.pad_token_id the pad id of
      the tokenizer in DIR, else BASE's), dtype float32, then PeftModel.from_pretrained(base, DIR);
      adapter_config.json's task_type must be CAUSAL_LM (dpo, orpo) or SEQ_CLS (reward). Every
      tensor of DIR/adapter_model.safetensors must equal the loaded PeftModel's parameter of that
      name (lora_A/lora_B ".default" dropped; "score.modules_to_save.default.weight" saved as
      "score.weight") exactly, and the PeftModel may have no LoRA / modules_to_save parameter the
      file lacks. Reward: also the head used in a forward pass is the modules_to_save copy and its
      output is F.linear(input, base_model.model.score.weight of the file), the reward being its
      value at the last token.
      Without --peft: AutoModelForSequenceClassification (reward; num_labels must be 1) or
      AutoModelForCausalLM .from_pretrained(DIR, output_loading_info=True) with no missing,
      unexpected or mismatched keys and no error; every tensor of DIR/model.safetensors (or its
      shards) equals the loaded model's state_dict entry (the file's cast to the loaded dtype)
      and the state_dict has no entry the file lacks; AutoTokenizer.from_pretrained(DIR) must load
      (reward always; dpo/orpo when DIR has tokenizer files).
      Prints one JSON line {"ok": true, "tensors": N, ...}; on any mismatch exits 1 with the
      list of problems on stderr.

What an independent implementation must reproduce (TRL 0.13.0, transformers 4.57.6)
-----------------------------------------------------------------------------------
Chat rows (dpo, orpo): data_utils.py maybe_extract_prompt (a no-op with an explicit prompt) then
maybe_apply_chat_template -> apply_chat_template: prompt = template(prompt messages,
add_generation_prompt=True); chosen = template(prompt + chosen messages)[len(prompt):] (no
generation prompt; a string slice, so here "2 + 3 = 5<|im_end|>\n"), rejected likewise; text
rows pass unchanged. AutoTrain passes these rows to TRL as they are (its chat_template option
None); its own chat path expects full conversations in chosen/rejected and is not used.
Reward rows: AutoTrain's reward path has no prompt column (utils.process_input_data renames
only chosen/rejected), so a row is given to it as the full conversation: text chosen = prompt +
chosen (string concatenation), chat chosen = apply_chat_template(prompt + chosen messages,
tokenize=False) (no generation prompt); rejected likewise.

DPO (trainer/dpo_trainer.py):
  * tokenize_row: prompt, chosen, rejected each tokenizer(text, add_special_tokens=False): NO BOS
    for a decoder-only model (add_special_tokens=is_encoder_decoder); EOS appended to chosen and
    rejected; then prompt = prompt[-max_prompt_length:] (keep the end), chosen =
    chosen[:max_completion_length], rejected likewise (keep the start; the EOS is lost when cut).
    (AutoTrain passes max_completion_length as DPOConfig's deprecated max_target_length.)
  * PreferenceCollator.torch_call: prompts left-padded, completions right-padded, pad id =
    tokenizer.pad_token_id (0). concatenated_inputs: rows [chosen_0..chosen_{B-1},
    rejected_0..rejected_{B-1}], prompt repeated, completions padded to the longer of the two.
  * concatenated_forward: ids = prompt ++ completion per row, flushed left (the left padding
    rolled to the right end), all-pad columns dropped, then every row cut to its first max_length
    tokens (truncation_mode is not used here). So row = (prompt ++ completion)[:max_length],
    right-padded with pad id 0 to the batch width, attention_mask 1 on real tokens, no
    position_ids (positions 0..L-1). One forward of all 2B rows (policy, training mode; the
    reference in a second forward under no_grad).
  * log-probs: logits[:, :-1] against ids[:, 1:], log_softmax over the vocabulary, gathered at
    the target; summed over the completion targets (the mask: completion tokens that survived the
    cuts; the first completion token is predicted by the last prompt token). logps = SUM per row.
  * dpo_loss (loss_type sigmoid, label_smoothing 0, f_divergence reverse_kl): z = (pi_c - pi_r) -
    (ref_c - ref_r); loss_i = -logsigmoid(beta z); loss = mean over the B rows.
  * metrics (get_batch_loss_metrics): rewards/chosen = mean_i beta (pi_c - ref_c);
    rewards/rejected likewise; rewards/accuracies = mean_i [beta(pi_c - ref_c) > beta(pi_r -
    ref_r)] (strict); rewards/margins = mean_i (reward_c - reward_r); logps/chosen = mean_i
    pi_c; logps/rejected = mean_i pi_r; logits/chosen = mean of the policy's raw logits over
    every (target position, vocab entry) of the chosen rows' loss mask (logits at t-1 for each
    masked target t, all V entries); logits/rejected likewise.
ORPO (trainer/orpo_trainer.py):
  * tokenize_row/build_tokenized_answer: full = tokenizer(prompt + answer, add_special_tokens=False),
    p = tokenizer(prompt, add_special_tokens=False); the answer is full[len(p):] (the split moved
    one token left if full's first len(p) ids differ from p: a merge across the boundary);
    trl/trainer/utils.py add_bos_token_if_needed puts BOS before the prompt unless it starts with
    it; add_eos_token_if_needed appends EOS to each answer unless it ends with it. Then, with
    longer = max(len(chosen), len(rejected)): if len(prompt) + longer > max_length the prompt
    keeps its last max_prompt_length tokens (the BOS goes too when cut); if len(prompt) + longer
    is still > max_length, each answer keeps its first max_length - max_prompt_length tokens.
    max_completion_length is NOT used for a decoder-only model. labels = ids with -100 on the
    prompt.
  * DPODataCollatorWithPadding then concatenated_inputs: chosen rows then rejected rows, right
    padded (ids with pad id 0, labels -100, attention 0) to the longest of all 2B rows; one
    forward (use_cache=False, positions 0..L-1).
  * logps (get_batch_logps, average_log_prob=True): per row the MEAN of log_softmax(logits[t-1])
    [ids[t]] over the answer tokens t (labels != -100).
  * nll_loss: CrossEntropyLoss (mean) of the chosen rows over EVERY non-pad target t >= 1,
    prompt tokens included (labels = ids where attention_mask is 1), pooled over the batch's
    chosen rows (sum of the token losses / their count).
  * odds_ratio_loss: log_odds = (pc - pr) - (log1p(-exp(pc)) - log1p(-exp(pr))) with pc, pr the
    mean log-probs; loss = nll_loss - mean_i beta logsigmoid(log_odds_i).
  * metrics: rewards/chosen = mean beta pc; rewards/rejected = mean beta pr; rewards/accuracies =
    mean [beta pc > beta pr]; rewards/margins = mean (beta pc - beta pr); logps/chosen = mean pc;
    logps/rejected = mean pr; logits/chosen = mean of ALL the chosen rows' logits over [B, L, V]
    (every position, padding and prompt included; L the padded width of the 2B rows);
    logits/rejected likewise; nll_loss; log_odds_ratio = mean logsigmoid(log_odds);
    log_odds_chosen = mean log_odds.
Reward (trainer/reward_trainer.py, AutoTrain's utils.preprocess_reward):
  * ids = tokenizer(text, truncation=True) (add_special_tokens: the post-processor's BOS, no EOS;
    truncation at model_max_length 128); rows with len(chosen ids) > max_length or
    len(rejected ids) > max_length dropped before batching (the batch is the first B rows left).
  * RewardDataCollatorWithPadding: chosen and rejected padded separately (tokenizer.pad, right,
    pad id 0) to their own longest; two forwards. transformers modeling_layers.py
    GenericForSequenceClassification: the score (score.weight @ hidden state, no bias) of the
    last token whose id is not the pad id (argmax of position * (id != pad)).
  * compute_loss: loss = mean_i -logsigmoid(r_c,i - r_r,i); no margin column; center_rewards_
    coefficient None (no centring term). TRL 0.13 logs no metric for a training step but the
    Trainer's: loss, grad_norm, learning_rate, epoch.
All: Trainer.training_step divides by gradient_accumulation (1); Trainer logs loss rounded to 4
digits (trainer.py _maybe_log_save_evaluate), grad_norm before clipping; DPO/ORPO's log() adds
the mean of the metrics stored since the last log (one step with logging_steps 1).
"""
import argparse
import json
import os
import shutil
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import torch
from safetensors.torch import save_file

import transformers
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CHATML = os.path.join(HERE, "..", "..", "..", "..", "text", "tests", "chat_templates", "chatml.jinja")

# ---------------------------------------------------------------------------------------------
# make-model: the tiny Llama and its tokenizer
# ---------------------------------------------------------------------------------------------

# ids 0..3; then the 256 ByteLevel byte pieces; then the learned merges.
SPECIALS = ["<pad>", "<s>", "<|im_end|>", "<|im_start|>"]
VOCAB_SIZE = 384

WORDS = ("apple river planet garden silver window forest rocket yellow pencil music bridge summer winter "
         "orange castle dragon button candle family market jungle mirror number pocket rabbit school tomato "
         "turtle violin cloud stone light water green house table chair bread horse train ocean paper smile "
         "tiger zebra lemon storm dance honey cat dog sun moon star tree fish bird book road blue red fire snow "
         "rain wind king ship milk gold").split()

# Prompts and answers of make-data (and the tokenizer's training corpus).
QUESTIONS = [
    "What is 2 + 3?",
    "Reverse the word \"cat\".",
    "Write the word \"moon\" in capital letters, please, and do not add anything else to the answer.",
    "How many letters are in \"river\"?",
    "Continue the sequence: 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, and then what comes next?",
    "Name a color.",
    "What is 12 + 30?",
    "You are a helpful assistant. Think about the question carefully. Which animal is larger, a cat or a horse?",
    "Say hi.",
    "Spell \"tree\" backwards.",
    "What is the opposite of summer, and what is the opposite of light, and what is the opposite of fire?",
    "Pick a fruit.",
]
CHOSEN = [
    "2 + 3 = 5",
    "\"cat\" reversed is \"tac\".",
    "MOON",
    "\"river\" has 5 letters: r, i, v, e and r. That is five letters in all, counted one by one.",
    "33",
    "Blue.",
    "12 + 30 = 42, because 10 + 30 = 40 and 2 more is 42.",
    "A horse is larger than a cat.",
    "Hi!",
    "\"eert\"",
    "The opposite of summer is winter, of light is dark, and of fire is water or snow.",
    "An apple, or an orange, or a lemon.",
]
REJECTED = [
    "2 + 3 = 6, I think, but I am not sure about it at all, so please check it yourself.",
    "tac",
    "moon",
    "Four.",
    "32, 33, 34",
    "The color of the sea is green, and the color of the sun is red, and the moon is blue.",
    "40",
    "A cat.",
    "Hello there, my friend! How are you today? I hope the weather is nice where you are.",
    "tree",
    "Winter.",
    "A tomato is a fruit.",
]


def corpus():
    lines = QUESTIONS + CHOSEN + REJECTED + [" ".join(WORDS)] + WORDS + [" " + w for w in WORDS]
    return lines + ["user assistant system the of and to in is that it for on with as was"]


def make_tokenizer(model_max_length=128):
    """A Llama 3 style byte-level BPE: ByteLevel pre-tokenizer (GPT-2 regex), merges learned on
    corpus(), ByteLevel decoder, TemplateProcessing "<s> $A" (BOS with add_special_tokens)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIALS, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", SPECIALS.index("<s>"))])
    with open(CHATML) as f:
        template = f.read()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>",
                                   pad_token="<pad>", additional_special_tokens=["<|im_start|>"],
                                   model_max_length=model_max_length, padding_side="right")
    fast.chat_template = template
    return fast


def make_model(args):
    tokenizer = make_tokenizer(args.max_positions)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.max_positions, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_dropout=0.0, attention_bias=False,
        mlp_bias=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    g = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():  # larger than _init_weights' std 0.02, so that the logits are not flat
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 2 * args.init_std * torch.randn(p.shape, generator=g))
            else:
                p.copy_(args.init_std * torch.randn(p.shape, generator=g))
    model.save_pretrained(args.out, safe_serialization=True)
    tokenizer.save_pretrained(args.out, save_jinja_files=False)
    print(json.dumps({"out": args.out, "vocab_size": len(tokenizer), "bos": tokenizer.bos_token_id,
                      "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id,
                      "transformers": transformers.__version__}))
    return 0


def make_data(args):
    n = len(QUESTIONS)
    with open(args.out, "w") as f:
        for i in range(args.rows):
            q, c, r = (" ".join(items[(i + j) % n] for j in range(args.repeat))
                       for items in (QUESTIONS, CHOSEN, REJECTED))
            if args.kind == "text":
                row = {"prompt": q, "chosen": " " + c, "rejected": " " + r}
            else:
                row = {"prompt": [{"role": "user", "content": q}],
                       "chosen": [{"role": "assistant", "content": c}],
                       "rejected": [{"role": "assistant", "content": r}]}
            f.write(json.dumps(row) + "\n")
    info = {"out": args.out, "kind": args.kind, "rows": args.rows}
    if args.repeat != 1:
        info["repeat"] = args.repeat
    print(json.dumps(info))
    return 0


# ---------------------------------------------------------------------------------------------
# step / train: TRL's trainers as AutoTrain 0.8.36 builds them
# ---------------------------------------------------------------------------------------------

def read_rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_tokenizer(model_dir):
    """AutoTrain's get_tokenizer with chat_template None (the tokenizer's own template kept),
    padding right: pad_token set (ours is), model_max_length kept (128 <= 2048)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return tokenizer


def reward_rows(rows, tokenizer, max_length):
    """AutoTrain's reward path on a row with an explicit prompt: the conversation prompt+chosen
    (prompt+rejected) is its `chosen` (`rejected`) column; chat rows rendered with
    apply_chat_template(messages, tokenize=False) (no generation prompt); then
    utils.preprocess_reward (tokenizer(text, truncation=True): BOS from the post-processor) and
    its filter len <= block_size. Returns (kept row indices, tokenized rows)."""
    kept, out = [], []
    for i, row in enumerate(rows):
        if isinstance(row["chosen"], str):
            chosen, rejected = row["prompt"] + row["chosen"], row["prompt"] + row["rejected"]
        else:
            chosen = tokenizer.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
            rejected = tokenizer.apply_chat_template(row["prompt"] + row["rejected"], tokenize=False)
        c, r = tokenizer(chosen, truncation=True), tokenizer(rejected, truncation=True)
        if len(c["input_ids"]) <= max_length and len(r["input_ids"]) <= max_length:
            kept.append(i)
            out.append({"input_ids_chosen": c["input_ids"], "attention_mask_chosen": c["attention_mask"],
                        "input_ids_rejected": r["input_ids"], "attention_mask_rejected": r["attention_mask"]})
    return kept, out


def build_trainer(args, rows, output_dir, lr, max_steps, batch, extra=None):
    """The TRL trainer for args.trainer as AutoTrain 0.8.36's train_clm_{dpo,orpo,reward}.py
    builds it (fp32, CPU, no gradient checkpointing, dropout 0), on `rows`. Returns (trainer,
    data row index of each train_dataset row)."""
    from datasets import Dataset
    from peft import LoraConfig
    import trl

    tokenizer = load_tokenizer(args.model)
    common = dict(output_dir=output_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
                  learning_rate=lr, max_steps=max_steps, num_train_epochs=1, logging_steps=1, save_strategy="no",
                  eval_strategy="no", gradient_accumulation_steps=1, report_to="none", lr_scheduler_type="constant",
                  optim="adamw_torch", warmup_ratio=0.0, weight_decay=0.0, max_grad_norm=1.0, seed=args.seed,
                  ddp_find_unused_parameters=False, gradient_checkpointing=False, remove_unused_columns=False,
                  use_cpu=True, disable_tqdm=True, dataloader_drop_last=False, ddp_backend=None)
    common.update(extra or {})
    peft_config = None
    if args.peft:
        targets = args.target_modules if args.target_modules == "all-linear" else args.target_modules.split(",")
        peft_config = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=0.0, bias="none",
                                 task_type="SEQ_CLS" if args.trainer == "reward" else "CAUSAL_LM",
                                 target_modules=targets)
    torch.manual_seed(args.seed)  # the LoRA A init (get_peft_model) and the reward's score head draw from it
    if args.trainer == "reward":
        config = transformers.AutoConfig.from_pretrained(args.model)
        config.num_labels = 1
        config.pad_token_id = tokenizer.pad_token_id
        config.pad_token = tokenizer.pad_token
        model = AutoModelForSequenceClassification.from_pretrained(args.model, config=config, dtype=torch.float32)
        model.resize_token_embeddings(len(tokenizer))
        kept, tokenized = reward_rows(rows, tokenizer, args.max_length)
        cfg = trl.RewardConfig(max_length=args.max_length, **common)
        trainer = trl.RewardTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(tokenized),
                                    processing_class=tokenizer, peft_config=peft_config)
        trainer.remove_callback(transformers.trainer_callback.PrinterCallback)
        return trainer, kept
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    dataset = Dataset.from_list(rows)
    if args.trainer == "dpo":
        ref = None
        if args.ref_model and not args.peft:
            ref = AutoModelForCausalLM.from_pretrained(args.ref_model, dtype=torch.float32)
            ref.resize_token_embeddings(len(tokenizer))
        cfg = trl.DPOConfig(beta=args.beta, max_length=args.max_length, max_prompt_length=args.max_prompt_length,
                            max_target_length=args.max_completion_length, **common)
        trainer = trl.DPOTrainer(model=model, ref_model=ref, args=cfg, train_dataset=dataset,
                                 processing_class=tokenizer, peft_config=peft_config)
    else:
        cfg = trl.ORPOConfig(beta=args.beta, max_length=args.max_length, max_prompt_length=args.max_prompt_length,
                             max_completion_length=args.max_completion_length, **common)
        trainer = trl.ORPOTrainer(model=model, args=cfg, train_dataset=dataset, processing_class=tokenizer,
                                  peft_config=peft_config)
    trainer.remove_callback(transformers.trainer_callback.PrinterCallback)  # as AutoTrain does
    return trainer, list(range(len(rows)))


def sequential(trainer):
    """Data in file order: the train sampler becomes a SequentialSampler (Trainer's is a
    RandomSampler); accelerate then shards its batches across the processes."""
    trainer._get_train_sampler = lambda *a, **k: torch.utils.data.SequentialSampler(trainer.train_dataset)


def randomize_lora(model, seed):
    """--random-lora: every LoRA A and B (and a modules_to_save copy) drawn N(0, 0.1^2), so that
    step 1's adapter is not zero (PEFT's B = 0 makes the policy equal the reference in DPO and
    every A gradient zero)."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (".lora_" in name or "modules_to_save" in name):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def init_weights(trainer, args):
    """The trainable weights before step 1: PEFT's own init (get_peft_model, already done), then
    --random-lora or --init-adapter DIR."""
    if args.init_adapter:
        load_init_adapter(trainer, args.init_adapter)
    elif args.random_lora:
        randomize_lora(trainer.model, args.seed)


def load_init_adapter(trainer, path):
    """--init-adapter DIR: every trainable parameter of the PeftModel the trainer built (the
    script's LoraConfig) takes its value from DIR/adapter_model.safetensors (PEFT's layout, e.g.
    written by replica), loaded with PEFT's set_peft_model_state_dict. Fails unless the file's
    keys are exactly the trainable parameters' adapter-file names (no tensor left over, no
    trainable parameter without a value), the shapes agree, DIR/adapter_config.json's r,
    lora_alpha, use_rslora and task_type are the script's, and afterwards every trainable
    parameter equals its tensor exactly."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file
    model = trainer.model
    if not hasattr(model, "peft_config"):
        raise SystemExit("--init-adapter needs --peft")
    with open(os.path.join(path, "adapter_config.json")) as f:
        given = json.load(f)
    cfg = model.peft_config["default"]
    for key, want in (("r", cfg.r), ("lora_alpha", cfg.lora_alpha), ("use_rslora", cfg.use_rslora),
                      ("task_type", str(getattr(cfg.task_type, "value", cfg.task_type)))):
        have = given.get(key, False if key == "use_rslora" else None)
        if have != want:
            hint = " (pass --lora-r/--lora-alpha to match)" if key in ("r", "lora_alpha") else ""
            raise SystemExit("--init-adapter %s: adapter_config.json has %s=%r, the script's LoraConfig %r%s"
                             % (path, key, have, want, hint))
    state = load_file(os.path.join(path, "adapter_model.safetensors"))
    params = dict(trainable(trainer))  # adapter-file name -> parameter
    extra, lacking = sorted(set(state) - set(params)), sorted(set(params) - set(state))
    if extra or lacking:
        raise SystemExit("--init-adapter %s: tensors matching no trainable parameter %s; trainable parameters "
                         "without a tensor %s" % (path, extra, lacking))
    bad = [(n, tuple(t.shape), tuple(params[n].shape)) for n, t in state.items() if t.shape != params[n].shape]
    if bad:
        raise SystemExit("--init-adapter %s: shapes differ (file, model): %s" % (path, bad))
    result = set_peft_model_state_dict(model, state)
    if result.unexpected_keys:
        raise SystemExit("--init-adapter %s: set_peft_model_state_dict did not place %s" % (path, result.unexpected_keys))
    differ = [n for n, p in params.items() if not torch.equal(p.detach(), state[n].to(p.dtype))]
    if differ:
        raise SystemExit("--init-adapter %s: after loading, parameters differ from the file: %s" % (path, differ))


def trainable(trainer):
    """(name, parameter) of every trainable parameter, named as PEFT's adapter_model.safetensors
    (with --peft) or the HF model's state_dict names it."""
    model = trainer.model
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not hasattr(model, "peft_config"):
        return params
    from peft.utils import get_peft_model_state_dict
    renamed = get_peft_model_state_dict(model, state_dict={n: p for n, p in params})
    by_id = {id(p): n for n, p in renamed.items()}
    out = [(by_id[id(p)], p) for n, p in params]
    if len(out) != len(renamed):
        raise SystemExit("trainable parameters and PEFT's saved names differ")
    return out


def sequences(trainer, batch):
    """Per row of the batch, the unpadded ids the policy sees and the targets that carry the
    loss (DPO, ORPO; 1 where the token is predicted and counted) or the scored token (reward)."""
    out = {}
    n = batch["input_ids_chosen" if "input_ids_chosen" in batch else "prompt_input_ids"].shape[0]
    if "input_ids_chosen" in batch:  # reward: score of the last non-pad token
        pad = trainer.model.config.pad_token_id
        for side in ("chosen", "rejected"):
            ids = batch["input_ids_" + side]
            for i in range(n):
                row = ids[i][batch["attention_mask_" + side][i].bool()]
                non_pad = (ids[i] != pad).int()
                last = int((torch.arange(ids.shape[1]) * non_pad).argmax())
                mask = torch.zeros(row.shape[0], dtype=torch.int64)
                mask[last] = 1
                out["ids.%s.%d" % (side, i)], out["mask.%s.%d" % (side, i)] = row.clone(), mask
        return out
    if "chosen_labels" in batch:  # ORPO: prompt + answer, labels -100 on the prompt
        for side in ("chosen", "rejected"):
            for i in range(n):
                keep = batch[side + "_attention_mask"][i].bool()
                out["ids.%s.%d" % (side, i)] = batch[side + "_input_ids"][i][keep].clone()
                out["mask.%s.%d" % (side, i)] = (batch[side + "_labels"][i][keep] != -100).long()
        return out
    # DPO: concatenated_forward's construction (prompt left-padded + completion right-padded,
    # flushed left, empty columns dropped, cut at max_length).
    c = trainer.concatenated_inputs(batch, padding_value=trainer.padding_value)
    ids = torch.cat((c["prompt_input_ids"], c["completion_input_ids"]), dim=1)
    att = torch.cat((c["prompt_attention_mask"], c["completion_attention_mask"]), dim=1)
    loss_mask = torch.cat((torch.zeros_like(c["prompt_attention_mask"]), c["completion_attention_mask"]), dim=1)
    for j in range(2 * n):
        keep = att[j].bool()
        row_ids, row_mask = ids[j][keep], loss_mask[j][keep]
        if trainer.args.max_length is not None:
            row_ids, row_mask = row_ids[:trainer.args.max_length], row_mask[:trainer.args.max_length]
        side, i = ("chosen", j) if j < n else ("rejected", j - n)
        out["ids.%s.%d" % (side, i)], out["mask.%s.%d" % (side, i)] = row_ids.clone(), row_mask.long()
    return out


def grad_norm(grads):
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))


def step(args):
    rows = read_rows(args.data)
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        trainer, kept = build_trainer(args, rows, tmp, lr=0.0, max_steps=1, batch=args.batch)
        init_weights(trainer, args)
        params = trainable(trainer)
        init = {"init." + n: p.detach().clone().contiguous() for n, p in params}
        examples = [trainer.train_dataset[i] for i in range(min(args.batch, len(trainer.train_dataset)))]
        batch = trainer._prepare_inputs(trainer.data_collator(examples))
        seen = []
        hook = trainer.model.register_forward_pre_hook(
            lambda m, a, kw: seen.append((kw.get("input_ids", a[0] if a else None), kw.get("attention_mask"))),
            with_kwargs=True)
        trainer.model.zero_grad(set_to_none=True)
        trainer.current_gradient_accumulation_steps = 1  # what train() sets with gradient_accumulation 1
        loss = trainer.training_step(trainer.model, batch)  # model.train(), compute_loss, backward
        hook.remove()
        stored = trainer._stored_metrics["train"] if hasattr(trainer, "_stored_metrics") else {}
        metrics = {k: float(torch.tensor(v).mean()) for k, v in stored.items()}
        if hasattr(trainer, "_stored_metrics"):
            trainer._stored_metrics.clear()
        grads = {"grad." + n: p.grad.detach().float().clone().contiguous() for n, p in params}
        metrics["grad_norm"] = grad_norm(list(grads.values()))
        tensors = {"loss": loss.detach().float().reshape(()).contiguous(), "rows": torch.tensor(kept[:len(examples)])}
        tensors.update(grads)
        tensors.update(init)
        for k, v in metrics.items():
            tensors["metric." + k] = torch.tensor(v, dtype=torch.float32)
        tensors.update(sequences(trainer, batch))
        # The ids fed to the policy (first forward of the step) are the ones written.
        fed_ids, fed_mask = seen[0]
        n = len(examples)
        for j in range(fed_ids.shape[0] if args.trainer != "reward" else 0):
            side, i = ("chosen", j) if j < n else ("rejected", j - n)
            fed = fed_ids[j][fed_mask[j].bool()]
            if not torch.equal(fed, tensors["ids.%s.%d" % (side, i)]):
                raise SystemExit("ids.%s.%d differ from what the model was fed" % (side, i))
        if args.peft:  # the names are those of PEFT's adapter file
            trainer.model.save_pretrained(os.path.join(tmp, "adapter"), safe_serialization=True)
            from safetensors.torch import load_file
            saved = set(load_file(os.path.join(tmp, "adapter", "adapter_model.safetensors")))
            if saved != {n for n, _ in params}:
                raise SystemExit("grad names differ from adapter_model.safetensors: %s" %
                                 sorted(saved ^ {n for n, _ in params}))
        info = {"trainer": args.trainer, "peft": bool(args.peft), "loss": float(loss), "metrics": metrics,
                "rows": kept[:len(examples)], "trainable": len(params), "trl": __import__("trl").__version__}
        if args.check_train:
            info["train_check"] = check_train(args, rows, tmp, float(loss), metrics)
        save_file(tensors, args.out)
    print(json.dumps(info))
    return 0


def check_train(args, rows, tmp, loss, metrics):
    """trainer.train() for one step (lr 0, the batch of the first B rows): its logged loss
    (rounded to 4 digits by Trainer), grad_norm and metrics against the step's."""
    trainer, _ = build_trainer(args, rows, os.path.join(tmp, "train"), lr=0.0, max_steps=1, batch=args.batch)
    init_weights(trainer, args)
    sequential(trainer)
    trainer.train()
    logged = trainer.state.log_history[0]
    worst = abs(logged["loss"] - round(loss, 4))
    for k, v in metrics.items():
        if k in logged:
            worst = max(worst, abs(logged[k] - v) / max(1.0, abs(v)))
    missing = sorted(set(logged) - set(metrics) - {"loss", "learning_rate", "epoch", "step"})
    if worst > 1e-5 or missing:
        raise SystemExit("trainer.train() logged %r, the step computed loss %r %r" % (logged, loss, metrics))
    return {"logged_loss": logged["loss"], "max_rel_diff": worst}



LAUNCH = ["--multi_gpu", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
          "--num_cpu_threads_per_process", "1", "--main_process_port", "0"]


def train(args):
    """Parent: re-runs this command under `accelerate launch --num_processes WORLD` (one process
    per rank, gloo on CPU). Worker (LOCAL_RANK set): the run itself."""
    if "LOCAL_RANK" not in os.environ:
        import subprocess
        os.makedirs(args.out, exist_ok=True)
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(args.world)] + LAUNCH + \
              [os.path.abspath(__file__)] + sys.argv[1:]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        run = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout)
            return run.returncode
        with open(os.path.join(args.out, "log.jsonl")) as f:
            logs = [json.loads(line) for line in f]
        print(json.dumps({"trainer": args.trainer, "peft": bool(args.peft), "world": args.world, "steps": len(logs),
                          "first": logs[0], "last": logs[-1], "out": args.out, "trl": __import__("trl").__version__}))
        return 0
    rank = int(os.environ["RANK"])
    rows = [dict(r, row=i) for i, r in enumerate(read_rows(args.data))]
    trainer, kept = build_trainer(args, rows, os.path.join(args.out, "trainer"), lr=args.lr, max_steps=args.steps,
                                  batch=args.batch)
    init_weights(trainer, args)
    if rank == 0:
        save_initial(trainer, os.path.join(args.out, "init"))
    sequential(trainer)
    batches = []
    collate = trainer.data_collator

    def recording(examples):
        batches.append([kept[i] if args.trainer == "reward" else int(ex["row"])
                        for i, ex in zip(_positions(trainer, examples), examples)])
        return collate(examples)

    trainer.data_collator = recording
    if args.timing:
        timing = add_timing(trainer, args)
    trainer.train()
    logs = [dict(h) for h in trainer.state.log_history if "loss" in h]
    for k, h in enumerate(logs):
        h["rows"] = batches[k]  # the data rows of this rank's batch at that step
    name = "log.jsonl" if rank == 0 else "log.rank%d.jsonl" % rank
    with open(os.path.join(args.out, name), "w") as f:
        for h in logs:
            f.write(json.dumps(h) + "\n")
    if args.timing:
        with open(os.path.join(args.out, "timing.jsonl" if rank == 0 else "timing.rank%d.jsonl" % rank), "w") as f:
            for k, t in enumerate(timing["steps"]):
                f.write(json.dumps(dict(t, step=k + 1, tokens=timing["tokens"][k])) + "\n")
    if rank == 0:
        trainer.save_model(args.out)  # AutoTrain's post_training_steps: the adapter (or model) into DIR
        shutil.rmtree(os.path.join(args.out, "trainer"), ignore_errors=True)  # output_dir: nothing saved there
    return 0


def batch_tokens(trainer, batch, max_length):
    """Tokens of the chosen and rejected sequences of a collated batch as the model is fed them,
    padding excluded (what `sequences` returns, counted from the masks alone)."""
    if "input_ids_chosen" in batch:  # reward
        return int(batch["attention_mask_chosen"].sum() + batch["attention_mask_rejected"].sum())
    if "chosen_labels" in batch:  # ORPO: prompt + answer per side
        return int(batch["chosen_attention_mask"].sum() + batch["rejected_attention_mask"].sum())
    prompt = batch["prompt_attention_mask"].sum(1)  # DPO: (prompt ++ completion)[:max_length]
    n = 0
    for side in ("chosen", "rejected"):
        total = prompt + batch[side + "_attention_mask"].sum(1)
        n += int((total.clamp(max=max_length) if max_length is not None else total).sum())
    return n


def add_timing(trainer, args):
    """--timing: perf_counter at every step's on_step_begin / on_step_end, and the tokens of every
    batch the (recording) collator built, in order."""
    import time
    out = {"steps": [], "tokens": []}
    collate = trainer.data_collator

    def counting(examples):
        batch = collate(examples)
        out["tokens"].append(batch_tokens(trainer, batch, trainer.args.max_length))
        return batch

    trainer.data_collator = counting

    class Timing(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            out["steps"].append({"t_begin": time.perf_counter()})

        def on_step_end(self, a, state, control, **kw):
            out["steps"][-1]["t_end"] = time.perf_counter()

    trainer.add_callback(Timing())
    return out


def _positions(trainer, examples):
    """Index in train_dataset of each example (reward rows carry no `row` column)."""
    if "row" in examples[0]:
        return [None] * len(examples)
    table = [tuple(r["input_ids_chosen"]) + (-1,) + tuple(r["input_ids_rejected"]) for r in trainer.train_dataset]
    return [table.index(tuple(ex["input_ids_chosen"]) + (-1,) + tuple(ex["input_ids_rejected"])) for ex in examples]


def save_initial(trainer, path):
    """The trainable parameters before step 1 (PEFT's adapter as save_pretrained writes it, or
    the whole model)."""
    trainer.model.save_pretrained(path, safe_serialization=True)


# ---------------------------------------------------------------------------------------------
# check-load: replica's final/ directory loaded by the real stack
# ---------------------------------------------------------------------------------------------

def _safetensors(directory, stem):
    """All tensors of DIR/STEM.safetensors, or of the shards its STEM.safetensors.index.json lists."""
    from safetensors.torch import load_file
    single = os.path.join(directory, stem + ".safetensors")
    if os.path.exists(single):
        return load_file(single)
    index = single + ".index.json"
    if not os.path.exists(index):
        raise SystemExit("check-load: %s has neither %s.safetensors nor its index" % (directory, stem))
    with open(index) as f:
        shards = sorted(set(json.load(f)["weight_map"].values()))
    out = {}
    for shard in shards:
        out.update(load_file(os.path.join(directory, shard)))
    return out


def _compare(file_tensors, loaded, what):
    """Exact equality of every file tensor with the loaded tensor of the same name (values and
    shape; the file's tensor cast to the loaded dtype); the name sets must be equal."""
    problems = []
    extra, lacking = sorted(set(file_tensors) - set(loaded)), sorted(set(loaded) - set(file_tensors))
    if extra:
        problems.append("%d tensor(s) of the file match nothing in the loaded %s: %s" % (len(extra), what, extra[:8]))
    if lacking:
        problems.append("%d tensor(s) of the loaded %s are not in the file: %s" % (len(lacking), what, lacking[:8]))
    differ = []
    for name in sorted(set(file_tensors) & set(loaded)):
        a, b = file_tensors[name], loaded[name].detach()
        if a.shape != b.shape:
            differ.append("%s shape %s (file) vs %s (loaded)" % (name, tuple(a.shape), tuple(b.shape)))
        elif not torch.equal(a.to(b.dtype), b):
            diff = float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
            differ.append("%s max |diff| %.3g" % (name, diff))
    if differ:
        problems.append("%d tensor(s) differ between the file and the loaded %s: %s" % (len(differ), what, differ[:8]))
    return problems


def _fail(args, problems):
    raise SystemExit("check-load --trainer %s%s --final %s: FAILED\n  %s" % (
        args.trainer, " --peft" if args.peft else "", args.final, "\n  ".join(problems)))


def _loading_info_problems(info):
    return ["from_pretrained: %s %s" % (k, info[k]) for k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                            "error_msgs") if info.get(k)]


def _has_tokenizer(directory):
    return any(os.path.exists(os.path.join(directory, f)) for f in ("tokenizer.json", "tokenizer_config.json"))


def check_load(args):
    """What replica wrote into final/ loaded by transformers / PEFT, tensor by tensor."""
    from peft import PeftModel
    info = {"trainer": args.trainer, "peft": bool(args.peft), "final": args.final}
    problems = []
    if not args.peft:
        cls = AutoModelForSequenceClassification if args.trainer == "reward" else AutoModelForCausalLM
        try:
            model, loading = cls.from_pretrained(args.final, output_loading_info=True)
        except Exception as e:  # noqa: BLE001 - a load that raises is the finding
            _fail(args, ["%s.from_pretrained(final) raised %s: %s" % (cls.__name__, type(e).__name__, e)])
        problems += _loading_info_problems(loading)
        if args.trainer == "reward" and model.config.num_labels != 1:
            problems.append("num_labels is %d, not 1" % model.config.num_labels)
        file_tensors = _safetensors(args.final, "model")
        problems += _compare(file_tensors, model.state_dict(), type(model).__name__ + " state_dict")
        info["class"] = type(model).__name__
        info["dtype"] = sorted({str(t.dtype).replace("torch.", "") for t in file_tensors.values()})
        info["pad_token_id"] = model.config.pad_token_id
        if args.trainer == "reward" or _has_tokenizer(args.final):
            try:
                tok = AutoTokenizer.from_pretrained(args.final)
                info["tokenizer"] = {"class": type(tok).__name__, "len": len(tok), "pad": tok.pad_token_id}
            except Exception as e:  # noqa: BLE001 - any failure to load is the finding
                problems.append("AutoTokenizer.from_pretrained(final) failed: %r" % e)
        else:
            info["tokenizer"] = None
        if problems:
            _fail(args, problems)
        info.update(ok=True, tensors=len(file_tensors))
        print(json.dumps(info))
        return 0

    # --peft: the base model from --base, the adapter from final/.
    with open(os.path.join(args.final, "adapter_config.json")) as f:
        adapter_config = json.load(f)
    file_tensors = _safetensors(args.final, "adapter_model")
    if args.trainer == "reward":
        tok_dir = args.final if _has_tokenizer(args.final) else args.base
        tok = AutoTokenizer.from_pretrained(tok_dir)
        base = AutoModelForSequenceClassification.from_pretrained(args.base, num_labels=1, dtype=torch.float32)
        base.config.pad_token_id = tok.pad_token_id
        info["pad_token_id"] = tok.pad_token_id
        want_task = "SEQ_CLS"
    else:
        base = AutoModelForCausalLM.from_pretrained(args.base, dtype=torch.float32)
        want_task = "CAUSAL_LM"
    if adapter_config.get("task_type") != want_task:
        _fail(args, ["adapter_config.json task_type %r, want %r" % (adapter_config.get("task_type"), want_task)])
    try:
        model = PeftModel.from_pretrained(base, args.final)
    except Exception as e:  # noqa: BLE001 - a load that raises is the finding
        _fail(args, ["PeftModel.from_pretrained(base, final) raised %s: %s" % (type(e).__name__, e)])
    model.eval()
    adapter = model.active_adapter
    # Every LoRA parameter (and modules_to_save copy) of the loaded PeftModel under the name PEFT's
    # adapter_model.safetensors gives it: ".<adapter>" dropped, "<m>.modules_to_save.<adapter>.x"
    # saved as "<m>.x".
    loaded = {}
    for name, p in model.named_parameters():
        if ".lora_" in name or ".modules_to_save." in name:
            key = name.replace(".modules_to_save.%s." % adapter, ".").replace(".%s." % adapter, ".")
            if key in loaded:
                problems.append("two loaded parameters map to %s" % key)
            loaded[key] = p
    problems += _compare(file_tensors, loaded, "PeftModel's LoRA parameters")
    info["lora_parameters"] = sum(1 for k in loaded if ".lora_" in k)
    if args.trainer == "reward":
        # The head in use: the active modules_to_save copy of `score`, seen in a forward pass.
        key = "base_model.model.score.weight"
        wrapper = model.base_model.model.score
        if key not in file_tensors:
            problems.append("the adapter file has no %s (modules_to_save score)" % key)
        elif not hasattr(wrapper, "modules_to_save") or adapter not in wrapper.modules_to_save:
            problems.append("score is not a modules_to_save copy in the loaded PeftModel (adapter_config "
                            "modules_to_save %r)" % adapter_config.get("modules_to_save"))
        else:
            head = wrapper.modules_to_save[adapter]
            seen = []
            hook = head.register_forward_hook(lambda m, a, out: seen.append((a[0].detach(), out.detach())))
            ids = torch.tensor([[tok.bos_token_id if tok.bos_token_id is not None else 1] + list(range(4, 12))])
            with torch.no_grad():
                logits = model(input_ids=ids).logits
            hook.remove()
            if not seen:
                problems.append("the modules_to_save score copy is not used in the forward pass")
            else:
                x, out = seen[0]
                expect = torch.nn.functional.linear(x, file_tensors[key].to(x.dtype))
                if not torch.equal(out, expect):
                    problems.append("the score head in use differs from %s of the file" % key)
                if not torch.equal(logits.reshape(-1), out[0, -1].reshape(-1)):
                    problems.append("the reward is not the head's output at the last token")
                info["score_head"] = "modules_to_save.%s" % adapter
    if problems:
        _fail(args, problems)
    info.update(ok=True, tensors=len(file_tensors), task_type=adapter_config.get("task_type"),
                r=adapter_config.get("r"), lora_alpha=adapter_config.get("lora_alpha"))
    print(json.dumps(info))
    return 0


def quiet():
    """One JSON line on stdout: no progress bars, warnings or Trainer log prints."""
    import warnings
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    import datasets
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def main():
    torch.set_num_threads(1)
    quiet()
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    mm = sub.add_parser("make-model")
    mm.add_argument("--out", required=True)
    mm.add_argument("--seed", type=int, default=0)
    mm.add_argument("--hidden", type=int, default=32)
    mm.add_argument("--layers", type=int, default=2)
    mm.add_argument("--heads", type=int, default=4)
    mm.add_argument("--kv-heads", type=int, default=2)
    mm.add_argument("--intermediate", type=int, default=64)
    mm.add_argument("--max-positions", type=int, default=128, help="also the tokenizer's model_max_length")
    mm.add_argument("--init-std", type=float, default=0.1)
    md = sub.add_parser("make-data")
    md.add_argument("--out", required=True)
    md.add_argument("--kind", default="text", choices=["text", "chat"])
    md.add_argument("--rows", type=int, default=8)
    md.add_argument("--repeat", type=int, default=1, help="items joined per text (longer rows)")
    st = sub.add_parser("step")
    tr = sub.add_parser("train")
    for sp in (st, tr):
        sp.add_argument("--trainer", required=True, choices=["dpo", "orpo", "reward"])
        sp.add_argument("--model", required=True)
        sp.add_argument("--data", required=True)
        sp.add_argument("--out", required=True)
        sp.add_argument("--ref-model", default="")
        sp.add_argument("--peft", action="store_true")
        sp.add_argument("--lora-r", type=int, default=4)
        sp.add_argument("--lora-alpha", type=int, default=8)
        sp.add_argument("--target-modules", default="all-linear")
        sp.add_argument("--random-lora", action="store_true")
        sp.add_argument("--init-adapter", default="", help="PEFT adapter dir: the trainable weights' initial values")
        sp.add_argument("--beta", type=float, default=0.1)
        sp.add_argument("--max-prompt-length", type=int, default=12)
        sp.add_argument("--max-completion-length", type=int, default=10)
        sp.add_argument("--max-length", type=int, default=0, help="block_size; default 20 (dpo, orpo), 80 (reward)")
        sp.add_argument("--seed", type=int, default=42)
    st.add_argument("--batch", type=int, default=4)
    st.add_argument("--check-train", action="store_true")
    tr.add_argument("--batch", type=int, default=2)
    tr.add_argument("--steps", type=int, default=20)
    tr.add_argument("--lr", type=float, default=1e-3)
    tr.add_argument("--world", type=int, default=2)
    tr.add_argument("--timing", action="store_true", help="DIR/timing*.jsonl: per-step times and tokens")
    cl = sub.add_parser("check-load")
    cl.add_argument("--trainer", required=True, choices=["dpo", "orpo", "reward"])
    cl.add_argument("--base", default="", help="the base model dir (with --peft)")
    cl.add_argument("--final", required=True, help="replica's final/ directory")
    cl.add_argument("--peft", action="store_true")
    args = p.parse_args()
    if args.cmd == "check-load" and args.peft and not args.base:
        p.error("check-load --peft needs --base")
    if getattr(args, "init_adapter", "") and not args.peft:
        p.error("--init-adapter needs --peft")
    if getattr(args, "init_adapter", "") and args.random_lora:
        p.error("--init-adapter replaces --random-lora: give one of them")
    if getattr(args, "max_length", None) == 0:
        args.max_length = 80 if args.trainer == "reward" else 20
    return {"make-model": make_model, "make-data": make_data, "step": step, "train": train,
            "check-load": check_load}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
