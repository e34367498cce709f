package engine

import "context"

// LoadCheckpoint reads and verifies a checkpoint's manifest and files. The device-state
// checksum is verified once per engine and file identity, not on every fork; hashing
// (hundreds of MiB for a large guest) stops with ctx's error when ctx ends.
func (e *Engine) LoadCheckpoint(ctx context.Context, name string) (*Checkpoint, error) {
	return e.cks.load(ctx, name)
}

// Checkpoints lists checkpoints with their live forks (an empty list, never nil).
func (e *Engine) Checkpoints() ([]CheckpointInfo, error) {
	return e.cks.list(e.vms.forksByParent(), e.flatBytes)
}

// flatBytes is the storage of the flattened RAM file of the checkpoint m (0: none).
func (e *Engine) flatBytes(m *checkpointManifest) int64 {
	if p := flatPath(e.paths, m); p != "" {
		return allocatedBytes(p)
	}
	return 0
}

// CheckpointInfo returns one checkpoint with its live forks, as Checkpoints lists it
// (its manifest is read, its files are not verified: see LoadCheckpoint).
func (e *Engine) CheckpointInfo(name string) (CheckpointInfo, error) {
	c, err := e.cks.read(name)
	if err != nil {
		return CheckpointInfo{}, err
	}
	info := c.Info()
	info.Forks, info.FlatBytes = e.vms.forksByParent()[name], e.flatBytes(&c.Manifest)
	return info, nil
}

// SetPinned pins or unpins a checkpoint. Unpinning a checkpoint whose forks are all gone
// deletes it.
func (e *Engine) SetPinned(ctx context.Context, name string, pinned bool) error {
	c, err := e.cks.load(ctx, name)
	if err != nil {
		return err
	}
	c.Manifest.Pinned = pinned
	if err := e.cks.save(c); err != nil {
		return err
	}
	if !pinned {
		e.cks.collect(name, e.vms.forksOf)
	}
	return nil
}
