#!/usr/bin/env bash
# Population-based search against the same starts trained independently, on the
# Calculator's word problems, from one SFT warm start (docs/training.md, "Population-based
# search"). Four members start from poor learning rates (two 10x too low, one 10x too
# high, one right); the population evolves every 5 steps, the independent runs never
# (--evolve-every 0); both spend the same 4 x 25 member-steps. Each run's best member (by
# its fitness on the validation slice of the train split) and the plain recipe are then
# evaluated greedily on the same 200 test tasks and compared pairwise.
#
#   bash examples/population_vs_independent.sh            # seed 0
#   SEED=1 bash examples/population_vs_independent.sh     # another seed (same SFT)
#
# About 45 min a seed on 2 CPU cores (AMX): the population 24 min, the independent runs
# 14, the plain recipe 3, the three evaluations 4 (docs/results.md#population).
set -euo pipefail
export HF_HUB_OFFLINE=1
SEED=${SEED:-0}
SFT=${SFT:-runs/sft/checkpoint}
OUT=${OUT:-runs/population_vs_independent/seed_$SEED}
ENV='{"source": "word_problems", "prompt_style": "compact"}'
STARTS='{"learning_rate": [5e-6, 5e-6, 5e-4, 5e-5]}'
RECIPE=(--config examples/calculator_grpo.yaml --init-from "$SFT" --seed "$SEED")

# 1. one SFT warm start for every run (docs/reproduce.md, "Calculator, word problems")
if [ ! -d "$SFT" ]; then
    agentenv sft Calculator-v0 --env-kwargs "$ENV" --num-demos 128 --epochs 2 \
        --output-dir "$(dirname "$SFT")"
fi
# 2. the search: 4 members, an evolution every 5 steps, 25 steps
agentenv train "${RECIPE[@]}" --population 4 --evolve-every 5 --member-start "$STARTS" \
    --output-dir "$OUT/population"
# 3. the same 4 starts trained independently: the same member-steps, never an evolution
agentenv train "${RECIPE[@]}" --population 4 --evolve-every 0 --member-start "$STARTS" \
    --output-dir "$OUT/independent"
# 4. the plain recipe (one run at its learning rate, 2e-4) beside them
agentenv train "${RECIPE[@]}" --output-dir "$OUT/plain"
# 5. the best member of each (eval --adapter on a population checkpoint takes its
#    fittest member and says which), and the plain run, on the same 200 test tasks
for run in population independent plain; do
    agentenv eval Calculator-v0 --env-kwargs "$ENV" --num-tasks 200 \
        --adapter "$OUT/$run/checkpoints/step_000025" --label "$run" \
        --output "$OUT/eval_$run.json"
done
agentenv eval --compare "$OUT/eval_independent.json" "$OUT/eval_population.json"
agentenv eval --compare "$OUT/eval_plain.json" "$OUT/eval_population.json"
# the learning rates each run ended with, and which member was the fittest
for run in population independent; do
    python - "$OUT/$run/checkpoints/step_000025/population.json" "$run" <<'EOF'
import json, sys

state = json.load(open(sys.argv[1]))
members = state["members"]
best = max(range(len(members)), key=lambda i: (members[i]["fitness"][-1], -i))
print(f"{sys.argv[2]}: best member {best}")
for m in members:
    lr, fit = m["hyperparameters"]["learning_rate"], m["fitness"][-1]
    print(f"  member {m['index']} (lineage {m['lineage_id']}): lr {lr:.2g}, fitness {fit:.3f}")
EOF
done
