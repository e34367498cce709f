package engine

import (
	"context"
	"fmt"
	"time"

	"github.com/forkvm/forkvm/memfile"
)

// worldCheckpoint checkpoints a VM with share=on RAM by copying it (see Checkpoint):
// save migrates device state with x-ignore-shared while the guest runs (QEMU stops it
// at completion); paused freezes the RAM file (a sparse copy). Its crash recovery is
// the pause's (recoverCheckpointing); its half-written files are reaped as any.
type worldCheckpoint struct{ resumes }

func (worldCheckpoint) save(ctx context.Context, p *qemuProc, w *ckWriter) (err error) {
	w.ck.Migration, err = p.saveToFileStats(ctx, w.statePath(), false)
	return err
}

func (worldCheckpoint) paused(ctx context.Context, vm *VM, s *vmState, w *ckWriter) (func(), error) {
	ck := w.ck
	t := time.Now()
	end := w.phase("freeze")
	fs, err := memfile.Freeze(ctx, s.Launch.RAM.Path, w.ramTmp)
	end()
	ck.Timings.Freeze = time.Since(t)
	if err != nil {
		return nil, fmt.Errorf("freeze ram: %w", err)
	}
	ck.Freeze, ck.RAMMethod = fs, "copy"
	return nil, nil
}
