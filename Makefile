# forkvm — build, set-up and tests. `make test` and `make fanout` install what is missing.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

GO      ?= go
BIN     := $(CURDIR)/bin
# The guest kernel/image cache; tests and benchmarks share it (built once per machine).
export FORKVM_CACHE ?= $(HOME)/.cache/forkvm
export PATH := /usr/local/go/bin:$(PATH)

QEMU_MIN_MAJOR := 10
# mmdebstrap builds Debian root images (`forkvm image create NAME --debian`); linux-perf
# is what TestKernelCounters compares the engine's counters with (`perf stat`); gcc builds
# the QEMU zygote's shim (engine Config.ZygoteShim).
APT_PKGS := busybox-static e2fsprogs mmdebstrap linux-perf gcc libc6-dev
# Go test flags for integration tests (they boot real VMs under TCG: give them time).
ITEST_TIMEOUT ?= 30m
ITEST_PARALLEL ?= 3
# Go test timeout of each unit test package and fuzz target (see unit-rest).
CHECK_TIMEOUT ?= 30m

# staticcheck, pinned: `make lint` installs this version into ./bin once (a single
# `go install`, about 20 s on a fresh machine; golangci-lint's build is several times that)
# and checks the module against staticcheck.conf.
STATICCHECK_VERSION := v0.8.2
STATICCHECK := $(BIN)/staticcheck-$(STATICCHECK_VERSION)

.PHONY: build shim setup setup-host image test fleet-then-vms prebuild-then-checks checks unit unit-fleet unit-rest prebuild lint itest itest-vms cross fuzz fuzz-ci fanout bench clean

## build: compile forkvm, forkbench and the static guest agent into ./bin
# The agent with -buildvcs=false: its bytes (and so the images it is baked into) change
# with its code, not with each commit; the guest package's tests build the same bytes,
# so a test run builds the Debian test recipe once, not once per agent.
build:
	@mkdir -p $(BIN)
	$(GO) build -o $(BIN)/forkvm ./cmd/forkvm
	$(GO) build -o $(BIN)/forkbench ./cmd/forkbench
	CGO_ENABLED=0 GOOS=linux $(GO) build -trimpath -buildvcs=false -ldflags='-s -w' -o $(BIN)/forkvm-agent ./cmd/forkvm-agent

## shim: the QEMU zygote's preload library (engine Config.ZygoteShim, --zygote), C: it
## takes QEMU's __libc_start_main (make setup installs gcc)
ZYGOTE_SHIM := $(BIN)/forkvm-zygote.so
shim: $(ZYGOTE_SHIM)
$(ZYGOTE_SHIM): engine/internal/qemu/zygote/zygote.c
	@mkdir -p $(BIN)
	cc -O2 -Wall -Wextra -shared -fPIC -o $@ $< -ldl

## setup: install QEMU >= 10 and guest tools when missing, build, build the guest image
# The packages install while the Go build compiles (on a fresh machine each takes about
# half a minute and a minute, the first mostly waiting on the network, the second on
# the CPU).
setup:
	$(MAKE) --no-print-directory -j2 --output-sync=target setup-host build
	$(MAKE) --no-print-directory image shim

setup-host:
	@command -v $(GO) >/dev/null || { echo "setup: Go is missing (install Go >= 1.26 at /usr/local/go)"; exit 1; }
	@need=""; \
	v=$$({ qemu-system-x86_64 --version 2>/dev/null || true; } | sed -n 's/.*version \([0-9]*\)\..*/\1/p' | head -1); \
	if [ -z "$$v" ] || [ "$$v" -lt $(QEMU_MIN_MAJOR) ] || ! command -v qemu-img >/dev/null; then need="qemu"; fi; \
	for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || need="$$need $$p"; done; \
	if [ -z "$$need" ]; then echo "setup: QEMU $$v and guest tools present"; exit 0; fi; \
	. /etc/os-release; codename=$${VERSION_CODENAME:-bookworm}; \
	cmds="apt-get update"; \
	if [ "$$codename" = bookworm ]; then \
	  bp='deb http://deb.debian.org/debian bookworm-backports main'; \
	  grep -rqs 'bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/ || \
	    cmds="echo '$$bp' > /etc/apt/sources.list.d/forkvm-backports.list && $$cmds"; \
	  qemu_install="apt-get install -y -t bookworm-backports qemu-system-x86 qemu-utils"; \
	else qemu_install="apt-get install -y qemu-system-x86 qemu-utils"; fi; \
	cmds="$$cmds && DEBIAN_FRONTEND=noninteractive $$qemu_install && DEBIAN_FRONTEND=noninteractive apt-get install -y $(APT_PKGS)"; \
	if [ "$$(id -u)" != 0 ]; then echo "setup: missing:$$need. Run as root:"; echo "  $$cmds"; exit 1; fi; \
	echo "setup: installing:$$need"; bash -c "$$cmds" >/tmp/forkvm-setup.log 2>&1 || { tail -20 /tmp/forkvm-setup.log; exit 1; }; \
	qemu-system-x86_64 --version | head -1

## image: fetch the guest kernel (Debian package) and build the initramfs (cached)
image: build
	$(BIN)/forkvm image build --agent $(BIN)/forkvm-agent

## unit: vet and unit tests (no VMs)
unit: unit-fleet unit-rest

# unit-fleet: the fleet's unit tests. Their nodes' heartbeats expire within seconds, so
# make test runs them before the VM tests load the machine, with only niced checks
# beside them (beside VMs a live node could miss its heartbeats for that long). The
# tests that lose a node run first, one at a time; the others (each with its own NATS
# server, mostly waiting on it) eight at a time.
unit-fleet:
	$(GO) test -count=1 -parallel 8 ./fleet/...

# unit-rest: vet, and the unit tests of every other package. CHECK_TIMEOUT bounds each
# package's run: make test runs them at the lowest priority (LOWEST), where a package
# waits for the CPU the VM tests leave, minutes at a time (go test's default of 10
# minutes of wall time once ended the guest package's tests, which take a minute).
unit-rest:
	$(GO) vet ./...
	$(GO) test -count=1 -timeout $(CHECK_TIMEOUT) $$($(GO) list ./... | grep -v -e '/tests$$' -e '/fleet$$' -e '/fleet/')

## lint: staticcheck (checks in staticcheck.conf) over the Linux build, and over the
## darwin build of the packages that have files of their own there (a _darwin file or a
## build line naming darwin or !linux): the others' darwin build is their Linux one.
DARWIN_PKGS = $(sort $(dir $(shell find . -name '*_darwin*.go' -not -path './.git/*'; grep -rlE --include='*.go' '^//go:build .*(darwin|!linux)' .)))
lint: $(STATICCHECK)
	@unformatted="$$(gofmt -l $$(git ls-files '*.go'))"; if [ -n "$$unformatted" ]; then echo "not gofmt'ed: $$unformatted"; exit 1; fi
	$(STATICCHECK) ./...
	CGO_ENABLED=0 GOOS=darwin GOARCH=arm64 $(STATICCHECK) $(DARWIN_PKGS)

$(STATICCHECK):
	@mkdir -p $(BIN)/.staticcheck
	GOBIN=$(BIN)/.staticcheck $(GO) install honnef.co/go/tools/cmd/staticcheck@$(STATICCHECK_VERSION)
	mv $(BIN)/.staticcheck/staticcheck $@
	rmdir $(BIN)/.staticcheck

## cross: the darwin build must keep compiling. No package uses cgo, so with CGO_ENABLED=0
## vet type-checks every darwin line (memfile reaches libSystem the way x/sys does).
# Of darwin/amd64 only procinfo is built: its assembly (libSystem trampolines) is the
# one source of ours that differs by architecture; every other darwin file is Go the
# arm64 build compiles, and a whole second darwin build cost a fresh machine a minute
# of CPU.
cross:
	CGO_ENABLED=0 GOOS=darwin GOARCH=arm64 $(GO) vet ./...
	CGO_ENABLED=0 GOOS=darwin GOARCH=arm64 $(GO) build ./...
	CGO_ENABLED=0 GOOS=darwin GOARCH=amd64 $(GO) build ./procinfo/

## fuzz: run each fuzz target briefly (by execution count: a -fuzztime duration can end
## in a spurious "context deadline exceeded" on a loaded machine)
fuzz: fuzz-ci
	$(GO) test -run='^$$' -fuzz=FuzzManifest -fuzztime=50000x ./engine/
	$(GO) test -run='^$$' -fuzz=FuzzParseJIT -fuzztime=50000x ./engine/
	$(GO) test -run='^$$' -fuzz=FuzzExt4Reader -fuzztime=20000x ./guest/

# fuzz-ci: the fuzz targets make test runs, those of packages that import few modules.
# Fuzzing instruments every non-standard package its target imports: the engine's and
# the guest package's (registry and Docker clients among them) took a fresh machine
# about a minute of CPU, in a suite bound by CPU. Their seeds run with the unit tests.
fuzz-ci:
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzDecode -fuzztime=100000x ./qmp/
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzReadFrame -fuzztime=100000x ./vsockd/
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzExtractTar -fuzztime=5000x ./vsockd/
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzParseSmaps -fuzztime=20000x ./procinfo/
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzParsePerCPUFree -fuzztime=20000x ./procinfo/
	$(GO) test -timeout $(CHECK_TIMEOUT) -run='^$$' -fuzz=FuzzDecodeRanges -fuzztime=20000x ./memfile/

## itest: integration tests that boot real QEMU
itest: setup
	$(MAKE) --no-print-directory itest-vms

# itest-vms: itest without its set-up. The tests marked parallel run ITEST_PARALLEL at a
# time: a VM test waits on its guests much of its time, and two at a time left a third
# of this 2-core machine idle.
itest-vms:
	rc=0; $(GO) test -count=1 -timeout $(ITEST_TIMEOUT) -parallel $(ITEST_PARALLEL) -v ./tests/ 2>&1 | tee /tmp/forkvm-itest.log | grep -E '^(=== RUN|--- |PASS|FAIL|ok|panic)|^ +--- FAIL|_test.go' || rc=$$?; \
	  [ $$rc = 0 ] || awk -f tests/failures.awk /tmp/forkvm-itest.log; exit $$rc

## test: everything CI runs, in two job slots. The first runs the fleet's unit tests,
## beside no VM (heartbeat timing), then the VM tests. The second runs, at the lowest
## CPU priority from the start (LOWEST), the checks that boot no VM: the compiles the VM
## tests need next, then the other unit tests (their Debian image builds included),
## lint, cross and fuzz-ci. They take the CPU the fleet's tests and the VM tests leave
## idle (both wait on NATS or on guests) instead of slowing them, and the VM tests start
## as soon as the fleet's end, not after a fresh machine's compiles. Each slot's output
## is printed when it ends; the VM tests' full log grows in /tmp/forkvm-itest.log
## meanwhile.
test: setup
	$(MAKE) --no-print-directory -j2 --output-sync=target fleet-then-vms prebuild-then-checks

fleet-then-vms:
	$(MAKE) --no-print-directory unit-fleet
	$(MAKE) --no-print-directory itest-vms

# LOWEST runs a command at the lowest CPU priority against everything else on the host.
# nice alone is not that where the kernel groups tasks by session (autogroup, on by
# default): nice then orders tasks only inside their session's group, and the groups
# share the CPU evenly. Every QEMU runs in a session of its own, so checks niced inside
# make's session still took that session's whole share beside each QEMU (a nice-19
# loop beside two busy sessions got 63% of a CPU, each of them 68%). In a session of
# their own whose group is niced 19 they get 2.4%: what the VMs leave. Without
# autogroup the write fails and nice does it.
LOWEST = setsid --wait sh -c 'echo 19 > /proc/self/autogroup 2>/dev/null; exec nice -n 19 "$$@"' lowest

prebuild-then-checks:
	$(LOWEST) $(MAKE) --no-print-directory prebuild
	$(LOWEST) $(MAKE) --no-print-directory checks

# prebuild: compiles, at the lowest CPU priority, the VM tests' binary and agent first
# (the VM tests build the same; the build cache shares it).
prebuild:
	nice -n 19 $(GO) test -c -o /dev/null ./tests/
	nice -n 19 env CGO_ENABLED=0 GOOS=linux $(GO) build -o /dev/null ./cmd/forkvm-agent

# checks: the other unit tests, then lint, cross and fuzz-ci, at the lowest CPU priority.
checks:
	nice -n 19 $(MAKE) --no-print-directory unit-rest lint cross fuzz-ci

## fanout: the main job — reproduce the published fork fan-out benchmark
fanout: setup
	$(BIN)/forkbench fanout $(FANOUT_ARGS)

## bench: Go benchmarks that boot VMs (boot -> first command, exec round trip)
bench: setup
	$(GO) test -run='^$$' -bench=. -benchtime=5x -timeout 30m ./tests/

clean:
	rm -rf $(BIN)
