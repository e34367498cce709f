package tests

import (
	"context"
	"fmt"
	"os"
	"sort"
	"strconv"
	"testing"
	"time"

	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/vsockd"
)

// Benchmarks that boot real VMs. Run with:
//
//	go test -run '^$' -bench . -benchtime 5x ./tests/
//
// Shape: $FORKVM_BENCH_CPUS vCPUs (2) and $FORKVM_BENCH_MEMORY_MB (2048), the published
// benchmark's shape. Each reports ms/op plus p50 as a custom metric.

func benchShape() (int, int) {
	cpus, mem := 2, 2048
	if v, err := strconv.Atoi(os.Getenv("FORKVM_BENCH_CPUS")); err == nil && v > 0 {
		cpus = v
	}
	if v, err := strconv.Atoi(os.Getenv("FORKVM_BENCH_MEMORY_MB")); err == nil && v > 0 {
		mem = v
	}
	return cpus, mem
}

func benchEnv(b *testing.B) *engine.Engine {
	b.Helper()
	home, err := os.MkdirTemp("/tmp", "fvb-")
	if err != nil {
		b.Fatal(err)
	}
	e, err := engine.New(context.Background(), &engine.Config{StateDir: home, CacheDir: cacheDir,
		Kernel: imageInfo.Kernel, Initrd: imageInfo.Initrd})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		ctx := context.Background()
		for _, vm := range e.List() {
			e.Delete(ctx, vm.Name)
		}
		cks, _ := e.Checkpoints()
		for _, c := range cks {
			e.DeleteCheckpoint(ctx, c.Name, &engine.DeleteCheckpointOptions{Force: true})
		}
		ram := e.Config().RAMDir
		e.Close()
		os.RemoveAll(ram)
		os.RemoveAll(home)
	})
	return e
}

func reportP50(b *testing.B, samples []time.Duration) {
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	if len(samples) > 0 {
		b.ReportMetric(float64(samples[len(samples)/2].Microseconds())/1000, "p50-ms")
		b.ReportMetric(float64(samples[len(samples)-1].Microseconds())/1000, "max-ms")
	}
	b.ReportMetric(0, "ns/op")
}

func firstCommand(ctx context.Context, vm *engine.VM) error {
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c", "true"}})
	if err == nil && code != 0 {
		err = fmt.Errorf("sh -c true exited %d", code)
	}
	return err
}

// BenchmarkBootToFirstCommand: Create (cold boot of a forkable VM: Spec.ColdBoot) until
// `sh -c true` returned.
func BenchmarkBootToFirstCommand(b *testing.B) {
	cpus, mem := benchShape()
	benchCreates(b, engine.Spec{CPUs: cpus, MemoryMiB: mem, Forkable: true, ColdBoot: true})
}

// BenchmarkCreateFromBootCache: Create of a forkable VM whose shape the boot cache
// holds (a first create, untimed, boots and leaves its boot there) until `sh -c true`
// returned.
func BenchmarkCreateFromBootCache(b *testing.B) {
	cpus, mem := benchShape()
	benchCreates(b, engine.Spec{CPUs: cpus, MemoryMiB: mem, Forkable: true})
}

// benchCreates times creates of VMs of spec (a name of their own each) until their
// first command, each deleted after. Unless spec boots cold, a first create, untimed,
// fills the boot cache, and each timed one must come from it.
func benchCreates(b *testing.B, spec engine.Spec) {
	e := benchEnv(b)
	ctx := context.Background()
	if !spec.ColdBoot {
		spec.Name = "first"
		if _, err := e.Create(ctx, spec); err != nil {
			b.Fatal(err)
		}
		e.Delete(ctx, spec.Name)
	}
	var samples []time.Duration
	for i := 0; b.Loop(); i++ {
		t0 := time.Now()
		spec.Name = fmt.Sprintf("c%d", i)
		vm, err := e.Create(ctx, spec)
		if err != nil {
			b.Fatal(err)
		}
		if vm.Info().BootCached == spec.ColdBoot {
			b.Fatalf("%s: boot cached %v, cold boot asked %v", vm.Name(), vm.Info().BootCached, spec.ColdBoot)
		}
		if err := firstCommand(ctx, vm); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(t0))
		b.StopTimer()
		e.Delete(ctx, vm.Name())
		b.StartTimer()
	}
	reportP50(b, samples)
}

// BenchmarkExecRoundTrip: `sh -c true` on a warm VM over the agent connection.
func BenchmarkExecRoundTrip(b *testing.B) {
	e := benchEnv(b)
	cpus, mem := benchShape()
	ctx := context.Background()
	vm, err := e.Create(ctx, engine.Spec{Name: "rt", CPUs: cpus, MemoryMiB: mem, Forkable: true})
	if err != nil {
		b.Fatal(err)
	}
	for range 3 { // warm the translation cache
		firstCommand(ctx, vm)
	}
	var samples []time.Duration
	for b.Loop() {
		t0 := time.Now()
		if err := firstCommand(ctx, vm); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(t0))
	}
	reportP50(b, samples)
}

// BenchmarkForkToFirstCommand: Fork of a checkpoint (300 MB dirtied) until `sh -c true`
// returned in the fork; each fork deleted after its sample (serial, like forkbench fork).
func BenchmarkForkToFirstCommand(b *testing.B) {
	e := benchEnv(b)
	cpus, mem := benchShape()
	ctx := context.Background()
	vm, err := e.Create(ctx, engine.Spec{Name: "world", CPUs: cpus, MemoryMiB: mem, Forkable: true, DiskMiB: 64})
	if err != nil {
		b.Fatal(err)
	}
	if code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c",
		"head -c 1048576 /dev/urandom > /dev/shm/seed && for i in $(seq 300); do cat /dev/shm/seed; done > /dev/shm/dirty"}}); err != nil || code != 0 {
		b.Fatal(code, err)
	}
	if _, err := e.Checkpoint(ctx, "world", "ck", &engine.CheckpointOptions{Pin: true}); err != nil {
		b.Fatal(err)
	}
	var samples, ready []time.Duration
	for i := 0; b.Loop(); i++ {
		t0 := time.Now()
		f, err := e.Fork(ctx, "ck", &engine.ForkOptions{Name: fmt.Sprintf("f%d", i)})
		if err != nil {
			b.Fatal(err)
		}
		ready = append(ready, time.Since(t0))
		if err := firstCommand(ctx, f); err != nil {
			b.Fatal(err)
		}
		samples = append(samples, time.Since(t0))
		b.StopTimer()
		e.Delete(ctx, f.Name())
		b.StartTimer()
	}
	sort.Slice(ready, func(i, j int) bool { return ready[i] < ready[j] })
	b.ReportMetric(float64(ready[len(ready)/2].Microseconds())/1000, "ready-p50-ms")
	reportP50(b, samples)
}

// BenchmarkCheckpoint measures checkpoints of a world with 300 MB of dirtied RAM: the
// default (RAM frozen by a sparse copy) and Handoff (RAM file renamed, the world
// restarted as a copy-on-write fork). Each handoff needs a fresh world, so the world is
// rebuilt (untimed) per iteration. Reports the checkpoint call and the world's pause.
func BenchmarkCheckpoint(b *testing.B) {
	for _, handoff := range []bool{false, true} {
		name := map[bool]string{false: "copy", true: "handoff"}[handoff]
		b.Run(name, func(b *testing.B) {
			e := benchEnv(b)
			cpus, mem := benchShape()
			ctx := context.Background()
			var total, paused []time.Duration
			for i := 0; b.Loop(); i++ {
				b.StopTimer()
				w, err := e.Create(ctx, engine.Spec{Name: fmt.Sprintf("w%d", i), CPUs: cpus, MemoryMiB: mem, Forkable: true, DiskMiB: 64})
				if err != nil {
					b.Fatal(err)
				}
				if code, err := w.Exec(ctx, &vsockd.ExecRequest{Argv: []string{"sh", "-c",
					"head -c 1048576 /dev/urandom > /dev/shm/seed && for i in $(seq 300); do cat /dev/shm/seed; done > /dev/shm/dirty"}}); err != nil || code != 0 {
					b.Fatal(code, err)
				}
				b.StartTimer()
				ck, err := e.Checkpoint(ctx, w.Name(), fmt.Sprintf("ck%d", i), &engine.CheckpointOptions{Handoff: handoff})
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				total = append(total, ck.Manifest.Timings.Total)
				paused = append(paused, ck.Manifest.Timings.Paused)
				e.Delete(ctx, w.Name())
				e.DeleteCheckpoint(ctx, ck.Manifest.Name, &engine.DeleteCheckpointOptions{Force: true})
				b.StartTimer()
			}
			sort.Slice(paused, func(i, j int) bool { return paused[i] < paused[j] })
			b.ReportMetric(float64(paused[len(paused)/2].Microseconds())/1000, "paused-p50-ms")
			reportP50(b, total)
		})
	}
}
