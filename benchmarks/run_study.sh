#!/usr/bin/env bash
# The savings study of docs/benchmarks.md: every point of its grid, resumable across sessions.
#
#   bash benchmarks/run_study.sh            # every point, in order
#   bash benchmarks/run_study.sh cpu-8x256-480 cpu-4x128-3840    # some points
#   bash benchmarks/run_study.sh --list     # the points
#   bash benchmarks/run_study.sh --seeds 2 cpu-8x256-480     # only the first two seeds of a point
#   bash benchmarks/run_study.sh ablation-8x256-480          # the recipe's ablation (one seed)
#
# All runs of a point are made by the code of one commit, benchmarks/STUDY_COMMIT (the scale study's
# pin), or benchmarks/<point>/STUDY_COMMIT where a point has its own (the ablation of a later
# recipe): the script runs the benchmark from a worktree of that commit, whatever main has become
# since, so a study continued by a later session on another machine never mixes code versions. Each finished run
# leaves a small JSON file in benchmarks/<point>/runs/ (commit them); a later call skips those and
# runs only what is missing, then remakes benchmarks/<point>/results.{json,md} and the plots.
# Killed in the middle, a run resumes from its last checkpoint (run directories: runs/study/).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_bin="${PYTHON:-python}"

# The compared methods, the same at every point (the recipe first, so that a seed stopped early has
# it): training from scratch (in every line, run once), each method with the settings the
# explorations of docs/benchmarks.md chose for it, at three budget fractions (the equal-quality
# measure; one where the full budget does not reach scratch's loss), over two seeds (three at the
# headline point).
FRACTIONS="--fractions 0.6 0.8 1.0"
# the recipe of the study's pin (the F-cycle with a quarter-length second visit), as the pinned
# benchmark's flags; the pin's code has no --recipe (later code: study.variants.RECIPE)
RECIPE="--shape depth --depth-pairing halves --depth-scaling identity --coarse-share 0.8 --ea 0.1 --optimizer-state map --after-warmup 0 --lr-schedule continue --interpolation correction --alpha 1.0"
RECIPES=(
  # the F-cycle of the pin: stacking's start (80% of the steps at half depth, grown
  # function-preserving), then a second coarse visit (depth only, halves, a quarter of the first)
  # whose change is added back whole (the coarse-grid correction, alpha 1), AdamW moments carried
  # through every transition, one learning-rate schedule over the whole run
  "--methods fcycle2 $RECIPE $FRACTIONS"
  # the recipe now (README, "The recipe"; chosen by the ablation, then the headline point's three
  # seeds): the same F-cycle with the second coarse visit half as long as the first
  "--methods fcycle2 $RECIPE --fcycle-revisit 0.5 --tag=-revisit0.5 $FRACTIONS"
  # progressive stacking with the same share, growth, moments and schedule (and no re-warm-up)
  "--methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue $FRACTIONS"
  # progressive stacking as published: half depth from scratch for half the steps, stacked,
  # AdamW restarted and re-warmed up
  "--methods stacking --depth-scaling ode $FRACTIONS"
  # the multilevel ODE strategy (Lauga et al.): 4 cycles of even/odd coarse models, half the steps
  # coarse, without the first-order coherence term (with AdamW it diverged: docs/benchmarks.md)
  "--methods ode2 --ea 0.1 --ode coherence=none --tag=-nocoherence --fractions 1.0"
)

declare -A POINTS=(
  # the headline point: the pilot's model (8 layers x 256) on 0.5M tokens
  [cpu-8x256-480]="--size cpu --steps 480"
  [cpu-8x256-240]="--size cpu --steps 240"
  [cpu-8x256-960]="--size cpu --steps 960"
  # the long budgets on the smaller model (4 layers x 128): 16x from first to last
  [cpu-4x128-240]="--size cpu-small --steps 240"
  [cpu-4x128-960]="--size cpu-small --steps 960"
  [cpu-4x128-3840]="--size cpu-small --steps 3840"
)
declare -A SEEDS=([cpu-8x256-480]=3 [ablation-8x256-480]=1 [ablation-8x256-480-b582310]=1)  # two elsewhere
ORDER=(cpu-8x256-480 cpu-4x128-240 cpu-4x128-960 cpu-8x256-240 cpu-8x256-960 cpu-4x128-3840)

# The ablation of the recipe (README, "The recipe": the F-cycle above with the half-length second
# visit, study.variants.RECIPE) at the headline point, one change at a time, each at the full budget
# (final loss and curve crossing), most telling first: the changes that ended under the previous
# recipe (width coalesced too, a 90% coarse share), alone and together, the coarse learning rate,
# the ODE strategy with the coarse level first and stacking given the same levers, then every
# lever of the previous recipe's ablation (benchmarks/ablation-8x256-480-b582310/) again. Its own
# pin: benchmarks/ablation-8x256-480/STUDY_COMMIT.
POINTS[ablation-8x256-480]="--size cpu --steps 480 --fractions 1.0"
ABLATION=(
  "--recipe"                                                                  # the recipe (fcycle2)
  "--recipe --shape width+depth --tag=-width+depth"                           # width coalesced too (coarse rate x3)
  "--recipe --shape width+depth --perturbation 0.05 --tag=-width+depth-p0.05"  # ... its copies made to differ
  "--recipe --coarse-share 0.9 --tag=-coarse0.9"                              # 90% of the steps coarse
  "--recipe --shape width+depth --coarse-share 0.9 --tag=-width+depth-coarse0.9"  # both
  "--recipe --coarse-lr-factor 1.5 --tag=-lr1.5"                              # the half-depth model's rate x1.5
  # the multilevel ODE strategy with the coarse level first (docs/benchmarks.md): moments mapped,
  # one schedule, at the recipe's share and at 90%
  "--methods ode2 --ea 0 --coarse-share 0.8 --lr-schedule continue --ode coherence=none cycles=1 prolongation=constant optimizer_state=map --tag=-first-constant-map"
  "--methods ode2 --ea 0 --coarse-share 0.9 --lr-schedule continue --ode coherence=none cycles=1 prolongation=constant optimizer_state=map --tag=-first-constant-map-c0.9"
  # progressive stacking with the recipe's share, growth, moments and schedule, and at 90%
  "--methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue"
  "--methods stacking --depth-scaling identity --coarse-share 0.9 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue-c0.9"
  "--recipe --fcycle-revisit 0.25 --tag=-revisit0.25"                         # the previous recipe
  "--recipe --fcycle-revisit 0.75 --tag=-revisit0.75"
  "--recipe --alpha 1.0 0.5 0.75"                                             # the correction's step size
  "--recipe --interpolation blend --alpha 0.5 --tag=-blend"                   # the paper's return: blend, alpha 0.5
  "--recipe --lr-schedule restart --tag=-restart"                             # every phase its own schedule (the paper)
  "--recipe --optimizer-state reset --tag=-reset"                             # AdamW restarted at every transition
  "--recipe --methods vcycle2 wcycle2"                                        # the V- and W-cycle, same settings
  "--recipe --after-warmup 19 --tag=-rewarm"                                  # re-warm-up (4%) after every return
  "--recipe --ea 0.1 0.05 0.2 --coarse-share 0.8 0.5 0.65"                    # fine steps before it; coarse share
  "--recipe --depth-pairing adjacent --tag=-adjacent"                         # coarse layer i = fine layers 2i, 2i+1
  "--recipe --compare-depth-scaling"                                          # the paper's and the ODE depth operators
  "--recipe --methods vcycle3"                                                # three levels
  "--recipe --coarse-lr-factor 2 --tag=-lr2"
)
ABLATION_B582310=(  # the previous recipe's ablation (pin b582310: benchmarks/ablation-8x256-480-b582310/)
  "--methods fcycle2 $RECIPE"                                                # the recipe
  "--methods fcycle2 $RECIPE --interpolation blend --alpha 0.5 --tag=-blend"  # the paper's return: blend, alpha 0.5
  "--methods fcycle2 $RECIPE --lr-schedule restart --tag=-restart"           # every phase its own schedule (the paper)
  "--methods fcycle2 $RECIPE --fcycle-revisit 0.1 --tag=-revisit0.1"         # the second coarse visit's length
  "--methods fcycle2 $RECIPE --fcycle-revisit 0.5 --tag=-revisit0.5"
  "--methods fcycle2 $RECIPE --alpha 1.0 0.5 0.75"                           # the correction's step size
  "--methods fcycle2 $RECIPE --optimizer-state reset --tag=-reset"           # AdamW restarted at every transition
  "--methods vcycle2 wcycle2 $RECIPE"                                        # the V- and W-cycle, same settings
  "--methods fcycle2 $RECIPE --after-warmup 19 --tag=-rewarm"                # re-warm-up (4%) after every return
  "--methods fcycle2 $RECIPE --ea 0.1 0.05 0.2 --coarse-share 0.8 0.5 0.65 0.9"  # fine steps before it; coarse share
  "--methods fcycle2 $RECIPE --depth-pairing adjacent --tag=-adjacent"       # coarse layer i = fine layers 2i, 2i+1
  "--methods fcycle2 $RECIPE --compare-depth-scaling"                        # the paper's and the ODE depth operators
  "--methods fcycle2 $RECIPE --extra-shapes width+depth"                     # width coalesced too (coarse rate x3)
  "--methods vcycle3 $RECIPE"                                                # three levels
)

POINTS[ablation-8x256-480-b582310]="${POINTS[ablation-8x256-480]}"

# The regime study (docs/benchmarks.md, "Where it pays"): points at 20 and more tokens per parameter
# (the embedding counted, as Chinchilla does), on models small enough for that on 2 CPU cores. Its
# own pins: benchmarks/<point>/STUDY_COMMIT. The two controls first, since they decide whether a
# point can show anything: training from scratch tuned (peak learning rate at 0.5x, 1x and 2x the
# size's, 4e-3: the best of 1e-3, 2e-3 and 4e-3 in a first pass on 4 x 64) and the coarse model
# alone (at the cycles' coarse rate and at half and twice it); then the schedules, swept with one
# seed at the full budget (a line marked "once:" runs with the first seed only): the coarse share,
# the second coarse visit's length, the recipe at the other rates, stacking with the same levers
# and as published. The schedules that matter then get the second seed and the budget fractions.
LONG=(
  "once: --recipe --methods coarse --scratch-lr 0.002 0.004 0.008 --fractions 1.0"  # the controls
  "once: --recipe --methods coarse --coarse-lr-factor 2 --tag=-lr2 --fractions 1.0"
  "once: --recipe --methods coarse --coarse-lr-factor 0.5 --tag=-lr0.5 --fractions 1.0"
  "once: --recipe --coarse-share 0.8 0.5 0.65 --fractions 1.0"                     # the coarse share
  "once: --recipe --fcycle-revisit 0.25 --tag=-revisit0.25 --fractions 1.0"         # the second visit
  "once: --recipe --fcycle-revisit 0.75 --tag=-revisit0.75 --fractions 1.0"
  "once: --recipe --fine-lr 0.002 --tag=-lr0.002 --fractions 1.0"                  # the recipe's rate
  "once: --recipe --fine-lr 0.008 --tag=-lr0.008 --fractions 1.0"
  "once: --methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue --fractions 1.0"
  "once: --methods stacking --depth-scaling ode --fractions 1.0"
  # every seed, at the budget fractions of the equal-quality measure: the controls, the recipe,
  # stacking with the same levers and as published
  "--recipe --methods coarse --scratch-lr 0.002 0.004 0.008 --fractions 0.6 0.8 1.0"
  "--recipe --fractions 0.6 0.8 1.0"
  "--methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue --fractions 0.6 0.8 1.0"
  "--methods stacking --depth-scaling ode --fractions 0.6 0.8 1.0"
)
POINTS[long-4x64-4700]="--size cpu-4x64 --steps 4700"   # 236,928 parameters, 20.3 tokens per parameter
POINTS[long-8x64-8600]="--size cpu-8x64 --steps 8600"   # 436,864 parameters, 20.2 tokens per parameter
# Where the smaller model suffices at 20 tokens per parameter (4 x 64: the coarse model alone ends
# under the best scratch), the point shows nothing about multilevel training: further out, the
# controls first, and the schedules only where the full model beats the smaller one. At 81 tokens
# per parameter it does (1.4612 against the coarse model's 1.4965): the schedules follow, the
# share first, then the controls' other rates, then every seed and fraction. The recipe's 80%
# share (about two thirds of the FLOPs at the coarse level, both visits) ends 0.038 above scratch
# here: shorter first visits next, for the F-cycle and for one growth with the same levers.
# one growth with the recipe's levers after a 20% first visit (what paid at 81 tokens per parameter)
STACK_SHARE02="--methods stacking --depth-scaling identity --coarse-share 0.2 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue-share0.2"
# progressive stacking as published: half depth for half the steps, AdamW restarted and re-warmed up
STACK_PUBLISHED="--methods stacking --depth-scaling ode"
LONG_CONTROLS=(
  "once: --recipe --methods coarse --scratch-lr 0.002 0.004 --fractions 1.0"
  "once: --recipe --coarse-share 0.8 0.2 0.1 --fractions 1.0"
  "once: $STACK_SHARE02 --fractions 1.0"
  # shares of 0.2 and 0.1 end under the best scratch at the full budget (stacking 1.4455, the
  # F-cycle 1.4501 and 1.4443, against 1.4612): the budget fractions of the equal-quality measure
  "once: $STACK_SHARE02 --fractions 0.8 0.6"
  "once: --recipe --coarse-share 0.1 --tag=-coarse0.1 --fractions 0.8 0.6"
  "once: --recipe --coarse-share 0.2 --tag=-coarse0.2 --fractions 0.8 0.6"
  "once: --recipe --coarse-share 0.8 0.5 0.65 --fractions 1.0"
  "once: --methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue --fractions 1.0"
  "once: $STACK_PUBLISHED --fractions 1.0"
  # stacking as published ended at 1.4431 (the F-cycle at 10% 1.4443) and led by ten points on
  # 8 x 32 at 80 tokens per parameter: its fractions
  "once: $STACK_PUBLISHED --fractions 0.8 0.6"
  "later: $STACK_PUBLISHED --fractions 1.0 0.8 0.6"
  "once: --recipe --methods coarse --coarse-lr-factor 0.5 --tag=-lr0.5 --fractions 1.0"
  "once: --recipe --methods coarse --coarse-lr-factor 2 --tag=-lr2 --fractions 1.0"
  "once: --recipe --fcycle-revisit 0.25 --tag=-revisit0.25 --fractions 1.0"
  # the two results (F-cycle at 10%, one growth with the levers at 20%) and their controls, every
  # seed: the first seed's runs are there already, a run directory per name, so these add the rest
  "--recipe --methods coarse --fractions 1.0"
  "--recipe --coarse-share 0.1 --tag=-coarse0.1 --fractions 1.0 0.8 0.6"
  "$STACK_SHARE02 --fractions 1.0 0.8 0.6"
)
POINTS[long-4x64-18800]="--size cpu-4x64 --steps 18800"  # 81.3 tokens per parameter (2.3 epochs)
# The second size at 80 tokens per parameter: GPT 8 x 32 (120,128 parameters), 9,400 steps (80.1
# tokens per parameter, 1.1 epochs; its own pin). The baseline at the size's rate and the control
# first, then the baseline's other two rates (together they decide whether the point can show
# anything), then the two schedules that paid on 4 x 64 at
# 81 tokens per parameter (the F-cycle with a 10% first visit, one growth with the levers at 20%) at
# the full budget, then their fractions. Named apart (long2-) from the regime study's points, whose
# report takes one pin for all of them.
LONG_8X32=(
  "--recipe --methods coarse --fractions 1.0"
  "--recipe --methods coarse --scratch-lr 0.002 0.008 --fractions 1.0"
  "--recipe --coarse-share 0.1 --tag=-coarse0.1 --fractions 1.0"
  "$STACK_SHARE02 --fractions 1.0"
  "--recipe --coarse-share 0.1 --tag=-coarse0.1 --fractions 0.8 0.6"
  "$STACK_SHARE02 --fractions 0.8 0.6"
)
POINTS[long2-8x32-9400]="--size cpu-8x32 --steps 9400"
LONG_POINTS=(long-4x64-4700 long-8x64-8600 long-4x64-18800 long2-8x32-9400)

# The scale study's points again with the control it lacked: training from scratch and the recipe's
# coarse model alone, on the same budget, two seeds (pinned as the regime study: one code version
# per table, so that the smaller model is compared with the scratch run of its own code).
CONTROLS=("--recipe --methods coarse --fractions 1.0")
for point in "${ORDER[@]}"; do
  POINTS[ctl-${point#cpu-}]="${POINTS[$point]}"
  CONTROL_POINTS+=("ctl-${point#cpu-}")
done

# The peers (docs/benchmarks.md, "The peers"): the published growth methods beside the recipe on
# the headline point's data and budget, one pin for all of them (its own STUDY_COMMIT), two seeds.
# The baseline tuned (scratch at half, one and twice the size's rate), the control, then every
# method at the full budget, then the budget fractions of the equal-quality measure. G_stack as
# published (a quarter-depth model, AdamW and the schedule restarted), for 10% of the steps: its
# growth-timing rule gives 6.8% of the tokens for 7B parameters on 300B (and more than the whole
# budget at this size); MSG with stacking's share and levers, the copies masked in over 5%.
STACK_LEVERS="--methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue"
MSG="--methods msg --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --msg-mask-share 0.05"
GSTACK="--methods gstack --gstack-factor 4 --gstack-share 0.1"
PEERS=(
  "--recipe --methods coarse --scratch-lr 0.0005 0.001 0.002 --fractions 1.0"
  "--recipe --fractions 1.0"
  "$STACK_LEVERS --fractions 1.0"
  "$GSTACK --fractions 1.0"
  "$MSG --fractions 1.0"
  "--recipe --fractions 0.6 0.8"
  "$STACK_LEVERS --fractions 0.6 0.8"
  "$GSTACK --fractions 0.6 0.8"
  "$MSG --fractions 0.6 0.8"
)
POINTS[peers-8x256-480]="--size cpu --steps 480"
# Every peer at the headline point from one code version, two seeds with the budget fractions: the
# lines above (their seed 1234 made by an earlier pin, peers-8x256-480) plus LiGO's learned depth
# operator (stacking's schedule and levers, 1% of the steps training the operator) and bert2BERT
# with FPI and with AKI width growth (the half-width, half-depth model, at the recipe's share). The
# baseline and the control first, then every method at the full budget (the peers no earlier pin
# ran first), then the budget fractions.
LIGO="--methods ligo --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0"
B2B="--methods bert2bert --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-levers"
PEERS2_METHODS=("$LIGO" "$B2B" "$B2B --bert2bert-init aki" "--recipe" "$STACK_LEVERS" "$GSTACK" "$MSG")
PEERS2=("${PEERS[0]}")
for line in "${PEERS2_METHODS[@]}"; do PEERS2+=("$line --fractions 1.0"); done
for line in "${PEERS2_METHODS[@]}"; do PEERS2+=("$line --fractions 0.6 0.8"); done
POINTS[peers2-8x256-480]="--size cpu --steps 480"
# The peers at the regime study's longest budget (80 tokens per parameter; the control is split
# there, the smaller model reaching scratch's loss in one seed of two), one seed with the budget
# fractions, at the second size's point (GPT 8 x 32, 9,400 steps: a run a third as long as 4 x 64's
# at 81), so that its table holds them beside the tuned
# baseline, the control, the F-cycle and stacking with the levers: G_stack as published and with
# the levers, MSG and LiGO's learned depth operator with the levers, bert2BERT as published (FPI
# width growth and stacking, AdamW and the schedule restarted); each with a 10% first phase at its
# small model (G_stack's published share); the full budget first. Progressive stacking as published
# (half depth for half the steps, AdamW restarted and re-warmed up) before them.
LONG_8X32+=(
  "once: $STACK_PUBLISHED --fractions 1.0"
  # stacking as published ended lowest of all at seed 1234 (1.7198, the F-cycle 1.7425): its
  # fractions and second seed, and the levers at its 50% share (the share apart from the restart)
  "once: $STACK_PUBLISHED --fractions 0.8 0.6"
  "later: $STACK_PUBLISHED --fractions 1.0 0.8 0.6"
  "once: ${STACK_SHARE02//0.2/0.5} --fractions 1.0"
  "once: $GSTACK --fractions 1.0"
  "once: $GSTACK --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-levers --fractions 1.0"
  "once: ${MSG/0.8/0.1} --fractions 1.0"
  "once: --methods bert2bert --coarse-share 0.1 --optimizer-state reset --lr-schedule restart --fractions 1.0"
  "once: ${LIGO/0.8/0.1} --fractions 1.0"
  # published stacking's growth taken apart at its 50% share: the restart with function-preserving
  # growth (identity), then the half-step copies (ode) with the levers; then the F-cycle with
  # half-step copies, at the 10% first visit that paid and at stacking's 50%
  "once: --methods stacking --depth-scaling identity --tag=-identity --fractions 1.0"
  "once: --methods stacking --depth-scaling ode --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-ode-map-continue --fractions 1.0"
  "once: --recipe --coarse-share 0.1 --depth-scaling ode --tag=-coarse0.1-ode --fractions 1.0"
  "once: --recipe --coarse-share 0.5 --depth-scaling ode --tag=-coarse0.5-ode --fractions 1.0"
  # G_stack as published ended lowest of all at seed 1234 (1.7071): its fractions; MSG with the
  # levers ended under scratch too (1.7385): its fractions
  "once: $GSTACK --fractions 0.8 0.6"
  "once: ${MSG/0.8/0.1} --fractions 0.8 0.6"
  # bert2BERT with FPI ended 0.50 above scratch, its equal width copies never told apart (no
  # dropout): its AKI growth, which breaks the symmetry
  "once: --methods bert2bert --bert2bert-init aki --coarse-share 0.1 --optimizer-state reset --lr-schedule restart --fractions 1.0"
  # LiGO with the levers ended under scratch (1.7586): its fractions
  "once: ${LIGO/0.8/0.1} --fractions 0.8 0.6"
)
# The peers at the regime study's longest point (GPT 4 x 64, 18,800 steps, 81 tokens per parameter,
# where the full model wins at both seeds), which the long point's pin predates: their own pin, one
# seed, the baseline at the size's rate (4e-3, the best of 2e-3, 4e-3 and 8e-3 there) rerun by this
# pin; G_stack as published first (the most on 8 x 32 at 80) with its fractions, then the others as
# on 8 x 32 at the full budget, then the fractions of those that reach scratch there (MSG, LiGO).
LONG3_4X64=(
  "once: $GSTACK --fractions 1.0"
  "once: $GSTACK --fractions 0.8 0.6"
  "once: ${MSG/0.8/0.1} --fractions 1.0"
  "once: ${LIGO/0.8/0.1} --fractions 1.0"
  "once: --methods bert2bert --bert2bert-init aki --coarse-share 0.1 --optimizer-state reset --lr-schedule restart --fractions 1.0"
  "once: ${MSG/0.8/0.1} --fractions 0.8 0.6"
  "once: ${LIGO/0.8/0.1} --fractions 0.8 0.6"
  "once: --methods bert2bert --coarse-share 0.1 --optimizer-state reset --lr-schedule restart --fractions 1.0"
  # MSG ended 0.035 under this pin's scratch, twice stacking as published's lead on the regime pin:
  # the same growth without the mask, and the F-cycle, at the same 10% share on this pin
  "once: ${STACK_SHARE02//0.2/0.1} --fractions 1.0"
  "once: --recipe --coarse-share 0.1 --tag=-coarse0.1 --fractions 1.0"
  "once: $STACK_PUBLISHED --fractions 1.0"
  # MSG led that control by 0.018: a second seed of the two, MSG with its fractions
  "later: ${MSG/0.8/0.1} --fractions 1.0"
  "later: ${STACK_SHARE02//0.2/0.1} --fractions 1.0"
  "later: ${MSG/0.8/0.1} --fractions 0.8 0.6"
)
POINTS[long3-4x64-18800]="--size cpu-4x64 --steps 18800"
SEEDS[long3-4x64-18800]=2

# the paper's 2-level V-cycle (width and depth, E_a 5%, alpha 0.5: its BERT-Base schedule)
VCYCLE2_PAPER="--methods vcycle2 --shape width+depth --ea 0.05 --coarse-share 0.5 --alpha 0.5 --tag=-paper"

# The BERT study (the paper's headline model; docs/benchmarks.md, "BERT"): BERT of the
# headline GPT's shape, masked-language modelling, at two budgets, two seeds. The baseline tuned,
# the control, then the recipe, stacking with its levers, the paper's 2-level V-cycle (width and
# depth, E_a 5%, alpha 0.5), the paper's 3-level structure and stacking as published, at the budget
# fractions of the equal-quality measure (the methods that paid at 480 steps first:
# at 1,920 a run takes about half an hour on two cores).
BERT=(
  "--recipe --methods coarse --scratch-lr 0.0005 0.001 0.002 --fractions 1.0"
  "--recipe $FRACTIONS"
  "$STACK_LEVERS $FRACTIONS"
  "$VCYCLE2_PAPER $FRACTIONS"
  "--methods vcycle3 --shape width+depth --ea 0.05 --coarse-share 0.5 --alpha 0.5 --tag=-paper $FRACTIONS"
  "--methods stacking --depth-scaling ode $FRACTIONS"
)
# BERT where the full model may beat the half-depth one: the 4 x 64 BERT at the regime study's
# vocabulary, 4,700 steps (20 tokens per parameter; its own pin, STUDY_COMMIT), two seeds. The
# baseline tuned (1e-3 added once 2e-3, the lowest rate first tried, ended best) and the control
# first, then every method at the full budget (the recipe also with the 10% first visit that paid
# at 81 tokens per parameter on GPT), then the budget fractions. The second seed ("later:" lines)
# repeats the best rate, the size's own rate (4e-3) and the control, and the two methods that
# reached the baseline's loss on the first seed (the recipe and stacking with its levers) at every
# fraction: the 10% first visit and the paper's V-cycle ended above it at the full budget.
BERT_LONG_METHODS=(
  "--recipe --coarse-share 0.1 --tag=-coarse0.1"
  "--recipe"
  "$STACK_LEVERS"
  "$VCYCLE2_PAPER"
)
BERT_LONG=("once: --recipe --methods coarse --scratch-lr 0.001 0.002 0.004 0.008 --fractions 1.0")
for line in "${BERT_LONG_METHODS[@]}"; do BERT_LONG+=("once: $line --fractions 1.0"); done
for line in "${BERT_LONG_METHODS[@]}"; do BERT_LONG+=("once: $line --fractions 0.6 0.8"); done
BERT_LONG+=(
  "later: --recipe --methods coarse --scratch-lr 0.002 0.004 --fractions 1.0"
  "later: --recipe $FRACTIONS"
  "later: $STACK_LEVERS $FRACTIONS"
)
POINTS[bert-4x64-4700]="--size cpu-bert-4x64 --steps 4700"
# The same BERT at four times the budget (18,800 steps, 81 tokens per parameter, the GPT regime
# study's longest point; its own pin, the same code as bert-4x64-4700): first only what decides
# whether the point can show anything, the baseline at the rate that was best at 4,700 steps and
# the control.
BERT_LONGER=("--recipe --methods coarse --scratch-lr 0.002 --fractions 1.0")
POINTS[bert-4x64-18800]="--size cpu-bert-4x64 --steps 18800"
SEEDS[bert-4x64-18800]=1
# The ODE strategy again (docs/benchmarks.md, "The ODE strategy, measured again"): the paper's model
# and optimizer (SGD), against the best-tuned baseline: training from scratch by SGD and by AdamW,
# each at three rates, with one cosine decay over the run or the peak held and the decay over the
# last third (the shape of the ODE runs' schedule), and the control (the coarse model alone); then
# the paper's own form (4 cycles alternating the even and odd coarse models) without and with the
# corrected coherence (adjoint restriction, v averaged over 4 batches), the coarse-first form
# (interleaved depth growth) and stacking at its share, at the budget fractions. The second seed
# ("later:" lines) repeats the best baseline of each optimizer, the control and every method at the
# full budget only: on the first seed no method's full budget reached the baseline's loss, so the
# fractions below it could only say "not reached" again.
ODE_METHODS=(
  "--methods ode2 --ea 0.1 --ode coherence=none --tag=-nocoherence"
  "--methods ode2 --ea 0.1 --ode coherence=first_order coherence_batches=4 --tag=-coherence4"
  "--methods ode2 --ea 0 --coarse-share 0.8 --lr-schedule continue --ode coherence=none cycles=1 prolongation=constant optimizer_state=map --tag=-first-constant-map"
  "--methods stacking --depth-scaling identity --coarse-share 0.8 --optimizer-state map --lr-schedule continue --after-warmup 0 --tag=-map-continue"
)
ODE=(
  "once: --methods coarse --scratch-lr 0.05 0.1 0.2 --scratch-decay-fraction 1 0.33 --fractions 1.0"
  "once: --methods coarse --scratch-optimizer adamw --scratch-lr 0.0005 0.001 0.002 --scratch-decay-fraction 1 0.33 --fractions 1.0"
  "later: --methods coarse --scratch-lr 0.2 --scratch-decay-fraction 0.33 --fractions 1.0"
  "later: --methods coarse --scratch-optimizer adamw --scratch-lr 0.001 --scratch-decay-fraction 0.33 --fractions 1.0"
)
for line in "${ODE_METHODS[@]}"; do ODE+=("once: $line $FRACTIONS"); done
for line in "${ODE_METHODS[@]}"; do ODE+=("later: $line --fractions 1.0"); done
POINTS[ode-12x256-480]="--size ode-paper --steps 480"
POINTS[bert-8x256-480]="--size cpu-bert --steps 480"
# The BERT configs' dropout (0.1, hidden and attention) at the 480-step point, one seed, its own pin:
# does it let width coalescing pay (the copies of a width-grown unit no longer receive identical
# updates)? The baseline at its two rates and the control with the same dropout, then the paper's
# 2-level V-cycle (width and depth), the recipe (depth only) and the recipe coalescing width too,
# at the full budget, then the fractions.
BERT_DROPOUT=(
  "--recipe --methods coarse --scratch-lr 0.0005 0.001 --fractions 1.0"
  "$VCYCLE2_PAPER --fractions 1.0"
  "--recipe --fractions 1.0"
  "--recipe --shape width+depth --tag=-width+depth --fractions 1.0"
  "$VCYCLE2_PAPER --fractions 0.6 0.8"
  "--recipe --fractions 0.6 0.8"
)
POINTS[bert-dropout-8x256-480]="--size cpu-bert --steps 480 --dropout 0.1"
SEEDS[bert-dropout-8x256-480]=1
POINTS[bert-8x256-1920]="--size cpu-bert --steps 1920"

recipes_of() {  # the recipe lines of a point
  case "$1" in
    bert-dropout-*) printf '%s\n' "${BERT_DROPOUT[@]}" ;;
    bert-4x64-18800) printf '%s\n' "${BERT_LONGER[@]}" ;;
    bert-4x64-*) printf '%s\n' "${BERT_LONG[@]}" ;;
    bert-*) printf '%s\n' "${BERT[@]}" ;;
    ode-*) printf '%s\n' "${ODE[@]}" ;;
    peers2-*) printf '%s\n' "${PEERS2[@]}" ;;
    peers-*) printf '%s\n' "${PEERS[@]}" ;;
    ablation-8x256-480-b582310) printf '%s\n' "${ABLATION_B582310[@]}" ;;
    ablation-*) printf '%s\n' "${ABLATION[@]}" ;;
    long-4x64-18800) printf '%s\n' "${LONG_CONTROLS[@]}" ;;
    long2-8x32-9400) printf '%s\n' "${LONG_8X32[@]}" ;;
    long3-4x64-18800) printf '%s\n' "${LONG3_4X64[@]}" ;;
    long-*) printf '%s\n' "${LONG[@]}" ;;
    ctl-*) printf '%s\n' "${CONTROLS[@]}" ;;
    *) printf '%s\n' "${RECIPES[@]}" ;;
  esac
}

max_seeds=""
if [[ "${1:-}" == "--seeds" ]]; then
  max_seeds="${2:?--seeds takes a number}"; shift 2
fi
if [[ "${1:-}" == "--list" ]]; then
  for point in "${ORDER[@]}" ablation-8x256-480 ablation-8x256-480-b582310 "${LONG_POINTS[@]}" \
      "${CONTROL_POINTS[@]}" long3-4x64-18800 peers-8x256-480 peers2-8x256-480 bert-8x256-480 bert-8x256-1920 bert-4x64-4700 bert-4x64-18800 bert-dropout-8x256-480 ode-12x256-480; do
    while IFS= read -r recipe; do
      echo "$point: ${POINTS[$point]} $recipe (seeds 1234 to $((1233 + ${SEEDS[$point]:-2})))"
    done < <(recipes_of "$point")
  done
  exit 0
fi
points=("$@")
[[ ${#points[@]} -gt 0 ]] || points=("${ORDER[@]}")
for point in "${points[@]}"; do
  [[ -n "${POINTS[$point]:-}" ]] || { echo "run_study.sh: unknown point $point (see --list)" >&2; exit 2; }
done

pin_of() {  # the commit whose code makes a point's runs: the point's own pin, else the study's
  local own="$root/benchmarks/$1/STUDY_COMMIT"
  if [[ -f "$own" ]]; then cat "$own"; else cat "$root/benchmarks/STUDY_COMMIT"; fi
}
for point in "${points[@]}"; do
  if [[ ! -f "$root/benchmarks/$point/STUDY_COMMIT" && ! -f "$root/benchmarks/STUDY_COMMIT" ]]; then
    echo "run_study.sh: benchmarks/STUDY_COMMIT names the commit whose code makes every run of the study;" >&2
    echo "  pin it once, before the first run: git rev-parse HEAD > benchmarks/STUDY_COMMIT (and commit it)" >&2
    exit 2
  fi
done
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$root/.cache/torch_extensions}"
for point in "${points[@]}"; do
  commit="$(pin_of "$point")"
  work="$root/.cache/study-${commit:0:12}"
  if [[ ! -d "$work" ]]; then
    git -C "$root" worktree add --detach "$work" "$commit" >/dev/null
  fi
  # the worktree shares main's data cache (corpus, tokenizer): made once, on a fresh machine too
  mkdir -p "$root/.cache/megatron_multilevel" "$work/.cache"
  ln -sfn "$root/.cache/megatron_multilevel" "$work/.cache/megatron_multilevel"
  echo "== $point (code of $commit)"
  # seed by seed, every method at every fraction: a study stopped early has whole seeds
  seeds=${SEEDS[$point]:-2}
  [[ -z "$max_seeds" || $max_seeds -ge $seeds ]] || seeds=$max_seeds
  mapfile -t recipes < <(recipes_of "$point")
  for ((s = 0; s < seeds; s++)); do
    for recipe in "${recipes[@]}"; do  # each line adds its method; the last report shows them all
      if [[ "$recipe" == "once: "* ]]; then  # a sweep: the first seed only
        [[ $s -eq 0 ]] || continue
        recipe="${recipe#once: }"
      elif [[ "$recipe" == "later: "* ]]; then  # the seeds after the first only
        [[ $s -gt 0 ]] || continue
        recipe="${recipe#later: }"
      fi
      # a run that fails (a port taken at its rendezvous by another job on the machine) is tried
      # again, twice: the benchmark runs only what is missing and resumes from the last checkpoint
      # (run directories per pin: a run never resumes from another code's checkpoint)
      for attempt in 1 2 3; do
        # shellcheck disable=SC2086
        if (cd "$work" && "$python_bin" tools/benchmark_savings.py ${POINTS[$point]} $recipe \
            --seed $((1234 + s)) --results "$root/benchmarks/$point" --out "$root/runs/study/$point-${commit:0:12}"); then
          break
        fi
        [[ $attempt -lt 3 ]] || { echo "run_study.sh: $point, seed $((1234 + s)): failed 3 times" >&2; exit 1; }
        echo "run_study.sh: $point, seed $((1234 + s)): failed, trying again ($((attempt + 1))/3)"
      done
    done
  done
done
