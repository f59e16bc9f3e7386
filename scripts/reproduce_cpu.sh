#!/usr/bin/env bash
# The CPU-scale mini-reproduction on the project's small data: five seeds for every norm at the
# recipe's learning rate on each task (main, translation, detection, lm), three for the probes:
#   main        every norm x {Swin-T, T2T-ViT} on the embedded digits
#   translation every norm on the synthetic corpus (fairseq); UN with the pad mask, and LN,
#               DyT, UN and PN trained three times as long (probes of their deficits)
#   translation_components  UN's components on it (Table 9) and a shorter gradient EMA
#   translation_ladder  every norm on the learning-rate ladder at a length where LN's BLEU is
#               off the floor and below saturation, and at the release's rate
#   micro_batch LN, BN, MABN, UN, BCN (with and without Weight Standardization, and micro-batch
#               BCN, EstBN, with it; WS on qkv and fc1 as a control), EvoNorm-B0/S0
#               on {Swin-T, T2T-ViT} with 2, 4 and 64 images per forward/backward
#   sepnorm     SepNorm on T2T-ViT: an LN or BN class-token norm at every site or the final one
#   detection   Mask R-CNN with LN, BN and UN on generated shapes
#   window_size, momentum, components   UN's sweeps on Swin-T (Tables 6, 10, 5)
#   ablation    UN's deficit on T2T-ViT: each component off, warm-up, window, momentum
#   old_rule    UN, MABN, PN, PN_LS under the previous CPU rule (warm-up 40, compensation 1000)
#   stability   every norm (and UN without outlier filtration) on T2T-ViT at 0.1x, 0.3x, 3x,
#               10x, 30x and 100x the recipe's learning rate (1x: the main runs)
#   test_time   the shift benchmark's models: LN and the seven norms with running statistics on
#               {Swin-T, T2T-ViT}, evaluated under every corruption, stream and test-time mode
#               (records in results/test_time, apart)
#   optimizer   AdamP against AdamW with LN, BCN with WS and WS alone, and the normalizer-free
#               baseline (NoNorm with scaled WS and AGC), at 1x, 3x and 10x on {T2T-ViT, Swin-T};
#               AdamP on the LM with qk-layernorm (records in results/optimizer, apart)
#   lm          the Llama-style decoder: every norm in Pre placement, LN and RMSNorm in Post,
#               Peri and Mix, Pre-LN with qk-layernorm and with z-loss
#   lm_stability  each of those on the learning-rate ladder (0.1x to 100x; 1x: the lm runs)
#   lm_init     Pre-, Post-, Peri- and Mix-LN with Peri-LN's embedding norm, and with Mix-LN's
#               release initialisation
#   lm_probes   UN's language-model deficit: its collapse without outlier filtration (statistics
#               recorded), and each of its phases off at 64 sequences a batch
#   lm_batch    LN and UN at 4 and 64 sequences per update (16: the lm runs), same tokens
#   graph       the Graph Transformer on generated CLUSTER and PATTERN and on FreeSolv: BN, LN
#               and UN first (the release's claim and the project's question), then MABN, PN,
#               PRepBN, DyT, RMS, GraphNorm and GRANOLA; three seeds (docs/graphs.md)
#   sentiment   every norm on the Rotten Tomatoes encoder at the CPU recipe (Post-LN placement)
#   sentiment_grid  the course study's grid (docs/text_classification.md#the-study-s-grid): plain
#               SGD, no warm-up, 7 learning rates x depth 1, 5 x widths 16, 32, 64: LN, BN, NoNorm
#               at Post first, with their U(-0.1, 0.1) and U(-100, 100) initialisations, then
#               UN, RMS, DyT, PRepBN, then all seven at Pre (records in results/sentiment_grid, apart)
#   sam         LN, BN and UN on {Swin-T, T2T-ViT}: SAM, SAM-ON and ASAM-ON (five seeds), and
#               norm-only training with and without the head (three); the base optimizer: the
#               main runs
# then the tables, the stability figures, the LM loss curves, PNAC/statistics figures and CKA.
#
# Runs go to $OUT (checkpoints, statistics, logs); their records (result.json, config.yaml,
# metrics.jsonl) are copied to results/runs/cpu, which scripts/make_tables.py reads. Runs that
# already have a result (in $OUT, or a committed record in $RECORDS) are skipped, so an
# interrupted reproduction continues where it stopped, on this machine or a fresh one. $JOBS runs at a time (default: one per core), one thread each.
#   bash scripts/reproduce_cpu.sh            # everything
#   bash scripts/reproduce_cpu.sh lm lm_stability   # only these groups' runs
#   bash scripts/reproduce_cpu.sh --list [group ...]   # the runs, one per line: <group>/<name> <overrides>
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/cpu_repro}
# where the records are copied; the tables and figures below read results/runs/cpu, so set
# it only to copy elsewhere (the tests do)
RECORDS=${RECORDS:-results/runs/cpu}
# the studies kept apart from the runs above, each in $STUDY_RECORDS/<group>: the shift
# benchmark's models and their evaluations (test_time: seeds 0-2 of LN ... PRepBN train the main
# runs again, for their checkpoints, and would count twice) and the optimizer study (its runs
# would join the other tables' families and their Holm corrections) and the graph task's runs
# (results/graph: their own page, results/graphs.md); their own analyses read
# them beside the runs above (analysis/test_time.py, analysis/optimizer.py)
STUDIES="test_time optimizer graph sentiment_grid"
STUDY_RECORDS=${STUDY_RECORDS:-results}
# where a record that the current CPU rule would train differently goes when its re-run lands
# (python -m analysis.runs --superseded: a warm-up shorter than the floor of issue 30)
SUPERSEDED_RECORDS=${SUPERSEDED_RECORDS:-results/superseded/warmup_before_floor}
JOBS=${JOBS:-$(nproc)}
NORMS="ln rms bn mabn pn pn_ls nonorm un dyt prepbn"
ANALYSED="swin_t_un swin_t_bn t2t_vit_14_un t2t_vit_14_ln"  # statistics recorded (seed 0)

MAIN_SEEDS="0 1 2 3 4"     # every norm at 1x on each task: the paper's count for IWSLT14
PROBE_SEEDS="0 1 2"        # sweeps, ablations, probes and the stability ladder
# the learning-rate ladder around the recipe's rate (1x: the main runs), log-spaced over three
# decades as Wortsman et al. (2023) sweep theirs (1e-4, 3e-4, ..., 1e-1)
LADDER="0.1 0.3 3 10 30 100"

runs() {  # one line per run: <group>/<name> <overrides...>
  for seed in $MAIN_SEEDS; do  # detection first: the longest runs
    for norm in ln bn un; do
      echo "detection/mask_rcnn_swin_t_${norm}-s$seed +exp=mask_rcnn_swin_t_$norm seed=$seed"; done
  done
  for seed in $MAIN_SEEDS; do
    for model in swin_t t2t_vit_14; do for norm in $NORMS; do
      extra=""
      [[ $seed == 0 && " $ANALYSED " == *" ${model}_$norm "* ]] && extra="record_statistics=true"
      echo "main/${model}_$norm-s$seed +exp=${model}_$norm seed=$seed${extra:+ $extra}"; done; done
    for norm in $NORMS; do
      echo "translation/iwslt14_$norm-s$seed +exp=iwslt14_$norm seed=$seed"; done
  done
  for seed in $PROBE_SEEDS; do
    echo "translation/iwslt14_un-padmask-s$seed +exp=iwslt14_un model.norm_pad_mask=true seed=$seed"
    for norm in ln dyt un pn; do
      echo "translation/iwslt14_$norm-3x-s$seed +exp=iwslt14_$norm recipe.train.max_update=1008 recipe.train.max_epoch=24 seed=$seed"; done
    for e in 2 3 4 5; do
      echo "translation_components/iwslt14_un-exp$e-s$seed +exp=iwslt14_un +ablation=un_exp$e seed=$seed"; done
    echo "translation_components/iwslt14_un-alpha0.5-s$seed +exp=iwslt14_un norm.momentum=0.5 seed=$seed"
    for m in 2 6 8 10; do
      echo "window_size/swin_t_un-M$m-s$seed +exp=swin_t_un norm.window_size=$m seed=$seed"; done
    for a in 0.8 0.7 0.6; do
      echo "momentum/swin_t_un-alpha$a-s$seed +exp=swin_t_un norm.momentum=$a seed=$seed"; done
    for e in 2 3 4 5; do
      echo "components/swin_t_un-exp$e-s$seed +exp=swin_t_un +ablation=un_exp$e seed=$seed"; done
    for change in norm.fwd_gm=false norm.bwd_am=false norm.bwd_ema=false \
                  norm.outlier_filtration=false norm.grad_compensation=false norm.warmup_iters=40 \
                  norm.warmup_iters=100 norm.window_size=2 norm.window_size=8 norm.momentum=0.5 \
                  norm.momentum=0.99; do
      label=${change#norm.}
      echo "ablation/t2t_vit_14_un-${label//=/-}-s$seed +exp=t2t_vit_14_un $change seed=$seed"; done
    for model in swin_t t2t_vit_14; do
      for norm in un mabn; do
        echo "old_rule/${model}_$norm-s$seed +exp=${model}_$norm norm.warmup_iters=40 norm.compensation_start=1000 seed=$seed"; done
      for norm in pn pn_ls; do
        echo "old_rule/${model}_$norm-s$seed +exp=${model}_$norm norm.warmup_iters=40 seed=$seed"; done
    done
    for lr in $LADDER; do
      for norm in $NORMS; do
        echo "stability/t2t_vit_14_$norm-lr${lr}x-s$seed +exp=t2t_vit_14_$norm lr_multiple=$lr seed=$seed"; done
      echo "stability/t2t_vit_14_un-noOF-lr${lr}x-s$seed +exp=t2t_vit_14_un norm.outlier_filtration=false lr_multiple=$lr seed=$seed"
    done
  done
  translation_ladder_runs
  literature_runs
  test_time_runs
  optimizer_runs
  for seed in $MAIN_SEEDS; do  # seed by seed, so that a stopped grid has whole seeds
    for model in swin_t t2t_vit_14; do for norm in ln bn un; do
      for sam in sam sam_on asam_on; do
        echo "sam/${model}_$norm-$sam-s$seed +exp=${model}_$norm sam=$sam seed=$seed"; done
      [[ " $PROBE_SEEDS " == *" $seed "* ]] || continue
      for only in norm norm+head; do
        echo "sam/${model}_$norm-only-${only/+/_}-s$seed +exp=${model}_$norm train_only=$only seed=$seed"; done
    done; done
  done
  lm_runs
  graph_runs
  sentiment_runs
}

# the course study's grid (docs/text_classification.md): its optimizer and schedule, and the
# grid's scale (width 16/32/64 with 2 heads and a 4x feed-forward, 32 tokens, 2,000 updates:
# the calibration, docs/text_classification.md#calibration), the landscape every 100 updates
SENTIMENT_RATES="10 1 0.5 0.1 0.01 0.001 0.0001"
SENTIMENT_GRID="optimizer=sgd optimizer.momentum=0 recipe.sched=constant recipe.warmup_steps=0 \
recipe.clip_grad=null recipe.weight_decay=0 recipe.max_steps=2000 recipe.eval_every=250 \
model.max_length=32 model.heads=2 record_landscape=100"
sentiment_runs() {
  for seed in $MAIN_SEEDS; do
    for norm in $NORMS bcn evonorm_b0 evonorm_s0 scalenorm; do
      echo "sentiment/sentiment_$norm-s$seed +exp=sentiment_$norm seed=$seed"; done
  done
  local placement norms depth width lr
  for placement in post pre; do
    for norms in "ln bn nonorm" "un rms dyt prepbn"; do
      [[ $placement == pre && $norms == "un rms dyt prepbn" ]] && continue
      [[ $placement == pre ]] && norms="ln bn nonorm un rms dyt prepbn"
      # the normal width first, so that a stopped grid holds whole slices
      for width in 32 16 64; do for norm in $norms; do for depth in 1 5; do for lr in $SENTIMENT_RATES; do
        echo "sentiment_grid/${placement}_d${depth}_w${width}_${norm}_lr$lr +exp=sentiment_$norm $SENTIMENT_GRID model.norm_position=$placement model.depth=$depth model.width=$width model.ffn=$((4 * width)) recipe.lr=$lr"
      done; done; done; done
      [[ $placement == post && $norms == "ln bn nonorm" ]] && sentiment_uniform_runs
    done
  done
}

sentiment_uniform_runs() {  # the study's two initialisations, at the normal width
  local norm depth a
  for norm in ln bn nonorm; do for depth in 1 5; do for a in 0.1 100; do
    echo "sentiment_grid/post_d${depth}_w32_${norm}_lr0.1_uniform$a +exp=sentiment_$norm $SENTIMENT_GRID model.norm_position=post model.depth=$depth model.width=32 model.ffn=128 recipe.lr=0.1 model.init=uniform model.init_range=$a"
  done; done; done
}

# translation off the floor and below saturation (results/calibration/translation): LN's BLEU
# nearest 50 at the CPU rate (2e-3) in 6 epochs of 42 updates, at the release's rate (7e-4) in 10
TRANSLATION_CPU_EPOCHS=6
TRANSLATION_RELEASE_EPOCHS=10

translation_ladder_runs() {  # every norm on the ladder at the CPU rate, and at the release's rate
  local length="recipe.train.max_update=$((TRANSLATION_CPU_EPOCHS * 42)) recipe.train.max_epoch=$TRANSLATION_CPU_EPOCHS"
  local release="recipe.train.lr=7e-4 recipe.train.max_update=$((TRANSLATION_RELEASE_EPOCHS * 42)) recipe.train.max_epoch=$TRANSLATION_RELEASE_EPOCHS"
  for norm in $NORMS; do
    for seed in $PROBE_SEEDS; do
      echo "translation_ladder/iwslt14_$norm-e$TRANSLATION_CPU_EPOCHS-s$seed +exp=iwslt14_$norm $length seed=$seed"
      echo "translation_ladder/iwslt14_$norm-release-e$TRANSLATION_RELEASE_EPOCHS-s$seed +exp=iwslt14_$norm $release seed=$seed"
    done
    for seed in 0 1; do for lr in $LADDER; do
      echo "translation_ladder/iwslt14_$norm-e$TRANSLATION_CPU_EPOCHS-lr${lr}x-s$seed +exp=iwslt14_$norm $length lr_multiple=$lr seed=$seed"; done; done
  done
  third_seed_at_best translation_ladder "$("$PY" -m analysis.sensitivity --best "$RECORDS/translation_ladder" "$OUT/translation_ladder")" \
    "$(for norm in $NORMS; do echo "iwslt14_$norm-e$TRANSLATION_CPU_EPOCHS +exp=iwslt14_$norm $length"; done)"
}

literature_runs() {  # the literature's other norms (issue 33)
  # micro-batch training, the BCN and MABN papers' question: the norms see 2 or 4 images per
  # forward/backward while each update accumulates the recipe's 64 (as 32 or 16 replicas
  # without synced statistics would); 64 is the recipe (LN, BN, MABN, UN: the main runs)
  for seed in $PROBE_SEEDS; do for size in 2 4 64; do for model in swin_t t2t_vit_14; do
    micro=$([[ $size == 64 ]] || echo "recipe.micro_batch_size=$size")
    for norm in ln bn mabn un bcn bcn_wsres bcn_est_wsres evonorm_b0 evonorm_s0 bcn_ws bcn_est_ws; do
      case $norm in
        ln|bn|mabn|un) [[ $size != 64 ]] || continue; exp="+exp=${model}_$norm" ;;
        # WS on the layers whose outputs the next norm reads (ws=residual), as the release
        # pairs a standardised layer with the norm after it; and the BCN paper's micro-batch
        # setting: BN's part normalised by its running estimates in training too (EstBN, the
        # README's BCNorm(..., estimate=True)), with WS
        bcn_wsres) exp="+exp=$model norm=bcn ws=residual" ;;
        bcn_est_wsres) exp="+exp=$model norm=bcn norm.estimate=true ws=residual" ;;
        # the control: WS on the layers after the norms (ws=transformer: qkv, fc1), whose
        # outputs grow by sqrt(fan-in) into the softmax and the activation
        bcn_ws) exp="+exp=$model norm=bcn ws=transformer" ;;
        bcn_est_ws) exp="+exp=$model norm=bcn norm.estimate=true ws=transformer" ;;
        *) exp="+exp=$model norm=$norm" ;;
      esac
      echo "micro_batch/${model}_$norm-mb$size-s$seed $exp${micro:+ $micro} seed=$seed"
    done
  done; done; done
  # SepNorm on T2T-ViT: LN tokens, an LN or BN class-token norm at every site or the final one
  for seed in $MAIN_SEEDS; do for class in ln bn; do for sites in all final; do
    echo "sepnorm/t2t_vit_14_ln-cls_$class-$sites-s$seed +exp=t2t_vit_14_ln model.class_norm=$class model.class_norm_sites=$sites seed=$seed"
  done; done; done
  # the language model's Pre placement (LN and the others: the lm runs)
  for seed in $PROBE_SEEDS; do for norm in bcn evonorm_s0; do
    echo "lm/llama_cpu_$norm-s$seed +exp=llama_71m_ln norm=$norm seed=$seed"
  done; done
}

third_seed_at_best() {  # <group> <"name rate" lines> <"name overrides" lines>: seed 2 at each
  # setting's best rate on the ladder where it has two seeds (not 1x, 3x or 10x)
  local group=$1 settings=$3
  while read -r name lr; do
    [[ -n $name ]] || continue
    overrides=$(awk -v name="$name" '$1 == name {$1 = ""; print substr($0, 2)}' <<< "$settings")
    [[ -n $overrides && $lr != 1 && ( $group != lm_stability || ( $lr != 3 && $lr != 10 ) ) ]] || continue
    echo "$group/$name-lr${lr}x-s2 $overrides lr_multiple=$lr seed=2"
  done <<< "$2"
}

TEST_TIME_NORMS="ln bn mabn pn un prepbn bcn evonorm_b0"

test_time_runs() {  # the shift benchmark's models (docs/test_time.md), checkpoints kept in $OUT:
  # LN and the norms that keep running statistics, at the recipe (ln ... prepbn at seeds 0-2 are
  # the main runs trained again, for their checkpoints)
  for seed in $PROBE_SEEDS; do for model in swin_t t2t_vit_14; do for norm in $TEST_TIME_NORMS; do
    echo "test_time/${model}_$norm-s$seed +exp=${model}_$norm seed=$seed"
  done; done; done
}

optimizer_runs() {  # AdamP against AdamW on scale-invariant weights, and the normalizer-free
  # baseline (docs/vision.md), at 1x, 3x and 10x the recipe's rate; AdamW's LN, NoNorm and BCN
  # with WS at 1x are the main and micro-batch runs, T2T-ViT's LN and NoNorm at 3x and 10x the
  # stability runs, the LM's Pre-LN with qk-layernorm the lm and lm_stability runs. Model by
  # model (T2T-ViT, the LM, Swin-T), so that a stopped grid has whole models.
  for model in t2t_vit_14 llama_cpu swin_t; do for seed in $PROBE_SEEDS; do for lr in 1 3 10; do
    rate=$([[ $lr == 1 ]] || echo "lr_multiple=$lr")
    tag=$([[ $lr == 1 ]] || echo "-lr${lr}x")
    if [[ $model == llama_cpu ]]; then
      echo "optimizer/llama_cpu_ln-qk_ln-adamp$tag-s$seed +exp=llama_71m_ln model.qk_norm=ln optimizer=adamp${rate:+ $rate} seed=$seed"
      continue
    fi
    for setting in "ln +exp=${model}_ln" "bcn_wsres +exp=$model norm=bcn ws=residual" \
                   "ws +exp=${model}_nonorm ws=residual"; do
      read -r name overrides <<< "$setting"
      echo "optimizer/${model}_$name-adamp$tag-s$seed $overrides optimizer=adamp${rate:+ $rate} seed=$seed"
      [[ $name == ln || ( $name == bcn_wsres && $lr == 1 ) ]] && continue  # recorded elsewhere
      echo "optimizer/${model}_$name$tag-s$seed $overrides${rate:+ $rate} seed=$seed"
    done
    clip=""; [[ $model != swin_t ]] || clip=" recipe.clip_grad=null"  # AGC instead of its clipping
    echo "optimizer/${model}_nf$tag-s$seed +exp=${model}_nonorm ws=nf recipe.agc=0.01$clip${rate:+ $rate} seed=$seed"
    if [[ $model == swin_t && $lr != 1 ]]; then for norm in ln nonorm; do
      echo "optimizer/${model}_$norm$tag-s$seed +exp=${model}_$norm $rate seed=$seed"; done; fi
  done; done; done
}

lm_runs() {  # the language-modelling testbed (docs/language_modelling.md)
  # the placements under the two embedding scales that flip them: Peri-LN's embedding norm on
  # every placement, and Mix-LN's release initialisation (the testbed's: the lm runs)
  for seed in $PROBE_SEEDS; do for position in pre post peri mix; do
    echo "lm_init/llama_cpu_ln-$position-embnorm-s$seed +exp=llama_71m_ln model.norm_position=$position model.embedding_norm=true seed=$seed"
    echo "lm_init/llama_cpu_ln-$position-mixln-s$seed +exp=llama_71m_ln model.norm_position=$position model.init=mixln seed=$seed"
  done; done
  for seed in $MAIN_SEEDS; do
    for norm in $NORMS; do
      echo "lm/llama_cpu_$norm-s$seed +exp=llama_71m_$norm seed=$seed"; done
  done
  for seed in $PROBE_SEEDS; do
    lm_ladder_settings | grep -v '^llama_cpu_[a-z_]* +exp=[a-z0-9_]*$' | while read -r name overrides; do
      echo "lm/$name-s$seed $overrides seed=$seed"; done
  done
  # the ladder: two seeds a rate, three at 3x and 10x (the first ladder's rates) and at each
  # setting's best rate (as the records rank them; analysis.sensitivity)
  lm_ladder_settings | while read -r name overrides; do
    for seed in $PROBE_SEEDS; do for lr in $LADDER; do
      [[ $seed != 2 || $lr == 3 || $lr == 10 ]] || continue
      echo "lm_stability/$name-lr${lr}x-s$seed $overrides lr_multiple=$lr seed=$seed"; done; done
  done
  third_seed_at_best lm_stability \
    "$("$PY" -m analysis.sensitivity --best "$RECORDS/lm" "$RECORDS/lm_stability" "$OUT/lm" "$OUT/lm_stability")" \
    "$(lm_ladder_settings)"
  # UN's deficit, probed (issue 30, item 4): its collapse without outlier filtration with the
  # statistics recorded (kept up to the collapse), and at 64 sequences a batch each of its
  # phases switched off in turn: which one fails there
  local b64="recipe.batch_size=64 recipe.micro_batch_size=64 recipe.max_steps=90 recipe.warmup_steps=9 recipe.eval_every=30"
  for seed in $PROBE_SEEDS; do
    echo "lm_probes/llama_cpu_un-noOF-stats-s$seed +exp=llama_71m_un norm.outlier_filtration=false record_statistics=true seed=$seed"
    # batch statistics in a causal model: BN pooled over every position against over the
    # positions up to each one (the lm runs: BN as configured)
    echo "lm_probes/llama_cpu_bn-causal-s$seed +exp=llama_71m_bn norm.causal=true seed=$seed"
    for change in norm.grad_compensation=false norm.bwd_ema=false norm.fwd_gm=false \
                  norm.outlier_filtration=false norm.warmup_iters=9 norm.warmup_iters=100000; do
      label=${change#norm.}
      echo "lm_probes/llama_cpu_un-b64-${label//=/-}-s$seed +exp=llama_71m_un $b64 $change seed=$seed"; done
  done
  # the same 737k training tokens (360 updates of 16 x 128) in 4x more or fewer updates; the
  # micro-batch is the batch, so that UN's and LN's statistics see the batch size swept
  for seed in $PROBE_SEEDS; do for norm in ln un; do
    echo "lm_batch/llama_cpu_$norm-b4-s$seed +exp=llama_71m_$norm recipe.batch_size=4 recipe.micro_batch_size=4 recipe.max_steps=1440 recipe.warmup_steps=144 recipe.eval_every=360 seed=$seed"
    echo "lm_batch/llama_cpu_$norm-b64-s$seed +exp=llama_71m_$norm recipe.batch_size=64 recipe.micro_batch_size=64 recipe.max_steps=90 recipe.warmup_steps=9 recipe.eval_every=30 seed=$seed"
  done; done
}

graph_runs() {  # the graph task (docs/graphs.md): the release's BN against LN, and UN, first
  for norms in "bn ln un" "mabn pn prepbn dyt rms graphnorm granola"; do
    for seed in $PROBE_SEEDS; do for data in cluster pattern freesolv; do for norm in $norms; do
      echo "graph/graph_transformer_${data}_$norm-s$seed +exp=graph_transformer_${data}_$norm seed=$seed"
    done; done; done
  done
}

lm_ladder_settings() {  # the LM's settings on the learning-rate ladder: <name> <overrides>
  # first what validates the testbed on Wortsman et al.'s findings: Pre-LN with and without
  # qk-layernorm and z-loss, Post-LN
  echo "llama_cpu_ln +exp=llama_71m_ln"
  echo "llama_cpu_ln-qk_ln +exp=llama_71m_ln model.qk_norm=ln"
  echo "llama_cpu_ln-post +exp=llama_71m_ln model.norm_position=post"
  echo "llama_cpu_ln-zloss +exp=llama_71m_ln recipe.z_loss=0.0001"
  for norm in $NORMS; do [[ $norm == ln ]] || echo "llama_cpu_$norm +exp=llama_71m_$norm"; done
  for position in peri mix; do echo "llama_cpu_ln-$position +exp=llama_71m_ln model.norm_position=$position"; done
  for position in post peri mix; do
    echo "llama_cpu_rms-$position +exp=llama_71m_rms model.norm_position=$position"; done
}

record_of() {  # <group>/<name>: where its records are committed
  if [[ " $STUDIES " == *" ${1%%/*} "* ]]; then echo "$STUDY_RECORDS/$1"; else echo "$RECORDS/$1"; fi
}
export -f record_of

run_one() {  # <group>/<name> <overrides...>
  local name=$1; shift
  if grep -qxF "$name" "$SUPERSEDED"; then  # made under an earlier rule: trained again
    [[ -e "$OUT/$name" && ! -f "$OUT/$name/.rerun" ]] && rm -rf "$OUT/$name"
    mkdir -p "$OUT/$name" && touch "$OUT/$name/.rerun"
    [[ -f "$OUT/$name/result.json" ]] && return 0
  else  # finished here, or recorded (committed) by an earlier grid on any machine
    [[ -f "$OUT/$name/result.json" || -f "$(record_of "$name")/result.json" ]] && return 0
  fi
  mkdir -p "$OUT/$(dirname "$name")"
  if ! "$PY" scripts/train.py "$@" scale=cpu logger=none "hydra.run.dir=$OUT/$name" \
      > "$OUT/$name.log" 2>&1; then
    echo "FAILED to run $name (see $OUT/$name.log)" >&2
    return 1
  fi
  echo "done $name"
}
export -f run_one
SUPERSEDED=$(mktemp)
trap 'rm -f "$SUPERSEDED"' EXIT
"$PY" -m analysis.runs --superseded "$RECORDS" > "$SUPERSEDED"
export PY OUT RECORDS STUDIES STUDY_RECORDS SUPERSEDED

listing=0
if [[ "${1:-}" == --list ]]; then listing=1; shift; fi
groups=$(runs | cut -d/ -f1 | sort -u)
for group in "$@"; do
  if ! grep -qx -- "$group" <<< "$groups"; then
    echo "unknown group '$group'; the groups: $(echo $groups)" >&2
    exit 2
  fi
done
selected() {  # the runs of the groups named on the command line (all without any)
  if (( $# == 0 )); then runs; else runs | grep -E "^($(IFS='|'; echo "$*"))/"; fi
}
if (( listing )); then
  selected "$@"
  exit 0
fi

if [[ "${SKIP_TRAINING:-0}" != 1 ]]; then
  threads=${OMP_NUM_THREADS:-$(( JOBS > 1 ? 1 : $(nproc) ))}  # a caller's thread count stands
  started=$SECONDS
  selected "$@" | OMP_NUM_THREADS=$threads xargs -r -d '\n' -n 1 -P "$JOBS" bash -c 'run_one $1' _
  echo "trained $(selected "$@" | wc -l) runs (finished ones skipped) in $(( (SECONDS - started) / 60 )) min, $JOBS at a time"
fi

# the records of every run finished since its last copy (this call's, or an interrupted
# call's) replace that run's older ones; a run copied before (marked .synced) is not copied
# again, so a later record of it (a re-run elsewhere, a relabelling) stays. Records of runs
# that are not under $OUT (another machine's, an earlier grid's) stay too.
for result in "$OUT"/*/*/result.json; do
  [[ -f "$result" ]] || continue  # nothing finished under $OUT: the pattern itself
  run=$(dirname "$result")
  [[ -f "$run/.synced" && ! "$result" -nt "$run/.synced" ]] && continue
  name="$(basename "$(dirname "$run")")/$(basename "$run")"
  dest=$(record_of "$name")
  if grep -qxF "$name" "$SUPERSEDED" && [[ -d "$dest" ]]; then  # kept, not overwritten
    mkdir -p "$SUPERSEDED_RECORDS/$(dirname "$name")"
    mv "$dest" "$SUPERSEDED_RECORDS/$name"
  fi
  rm -rf "$dest"
  mkdir -p "$dest"
  cp "$run"/result.json "$run"/config.yaml "$dest"/
  [[ -f "$run/metrics.jsonl" ]] && cp "$run"/metrics.jsonl "$dest"/  # a run that collapsed in epoch 1 has none
  [[ -f "$run/landscape.jsonl" ]] && cp "$run"/landscape.jsonl "$dest"/  # record_landscape's probes
  touch "$run/.synced"
done
# the shift benchmark (docs/test_time.md) on the test_time runs' checkpoints: every corruption
# at severities 3 and 5 and clean; source once (its evaluation reads no stream), the four
# test-time modes on each stream; LN, which keeps no statistic, at source. A setting with a
# record is skipped, so an interrupted evaluation continues.
evaluate_shift() {  # <run directory under $OUT/test_time>
  local run=$1 shifts="none all:3 all:5"
  "$PY" scripts/evaluate.py "$run" --missing --shift $shifts > "$run.shift.log" 2>&1 || return 1
  [[ $(basename "$run") == *_ln-s* ]] && return 0
  "$PY" scripts/evaluate.py "$run" --missing --shift $shifts --test-time tbn alpha ema unmix \
    --stream iid sorted dirichlet >> "$run.shift.log" 2>&1 || return 1
  echo "evaluated $run"
}
export -f evaluate_shift
if selected "$@" | grep -q '^test_time/'; then
  find "$OUT/test_time" -mindepth 2 -maxdepth 2 -name result.json -printf '%h\n' 2>/dev/null | sort \
    | OMP_NUM_THREADS=1 xargs -r -n 1 -P "$JOBS" bash -c 'evaluate_shift $1 || echo "FAILED to evaluate $1 (see $1.shift.log)" >&2' _
  for run in "$OUT"/test_time/*/test_time; do  # new records only: none is overwritten
    [[ -d "$run" ]] || continue
    dest="$(record_of "test_time/$(basename "$(dirname "$run")")")/test_time"
    mkdir -p "$dest" && cp -n "$run"/*.json "$dest"/
  done
fi

"$PY" scripts/make_tables.py
"$PY" -m analysis.stability
if [[ -d results/runs/cpu/lm ]]; then "$PY" -m analysis.lm_curves; fi
[[ -d "$OUT/main" ]] || exit 0  # the figures below read the main runs' statistics and checkpoints
for exp in $ANALYSED; do
  "$PY" scripts/analyze_run.py "$OUT/main/$exp-s0" --out "results/analysis/$exp-cpu"
done
for exp in swin_t_un t2t_vit_14_un; do
  "$PY" -m analysis.estimates "$OUT/main/$exp-s0" --out "results/analysis/estimates_$exp-cpu"
done
"$PY" scripts/cka.py "$OUT/main/t2t_vit_14_ln-s0" "$OUT/main/t2t_vit_14_un-s0" \
  --out results/analysis/cka_t2t_vit_14_ln_vs_un-cpu
"$PY" scripts/cka.py "$OUT/main/t2t_vit_14_ln-s0" "$OUT/main/t2t_vit_14_bn-s0" \
  --out results/analysis/cka_t2t_vit_14_ln_vs_bn-cpu
