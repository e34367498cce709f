package api

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"time"
)

// ErrDigest reports a file of a checkpoint being pulled from another host whose content
// does not match the digest its holder recorded (corrupted at the source or in
// transit); nothing of the checkpoint is kept.
var ErrDigest = errors.New("checkpoint file digest mismatch")

// ErrInsufficientSpace reports a checkpoint being pulled whose files do not fit the free
// space of the file systems they would be written to: it is refused before a byte is
// written (a full file system met later is ENOSPC, code insufficient_storage).
var ErrInsufficientSpace = errors.New("engine: insufficient space for the checkpoint")

// CheckpointExportSchema names the CheckpointExport object.
const CheckpointExportSchema = "forkvm.checkpoint-export/v1"

// CheckpointExport is what a checkpoint's holder tells a host that pulls it
// (GET /v1/checkpoints/{name}/export): the checkpoint's manifest in its relocatable
// form (paths relative to the holder's directories, which the puller replaces with its
// own) and every file a fork of it needs, each with its digest and data extents.
type CheckpointExport struct {
	Schema     string `json:"schema"`
	Checkpoint string `json:"checkpoint"`
	// Manifest is the engine's checkpoint manifest (version 2: no host paths but the
	// boot files', which are matched by digest). Its fields are the engine's.
	Manifest json.RawMessage `json:"manifest"`
	// QEMUVersion and Accel are what a fork of it needs on the pulling host.
	QEMUVersion string           `json:"qemu_version"`
	Accel       string           `json:"accel"`
	Files       []CheckpointFile `json:"files"`
}

// CheckpointFile is one file of a CheckpointExport. Name is its name in the export
// ("state.mig", "ram/ck-NAME.ram", "boot/kernel", ...), the key to fetch it with
// (GET /v1/checkpoints/{name}/export/file?name=...). SHA256 is its content digest:
// SHA-256 over its size (8 bytes, little endian) and then each 4 KiB page that is not
// all zeros, in offset order, as its offset (8 bytes) and its bytes; so holes and
// zero pages never need to travel and a file's layout on disk does not change it.
// Extents are the byte ranges that may hold data (page aligned); the rest reads as
// zeros.
type CheckpointFile struct {
	Name    string   `json:"name"`
	Size    int64    `json:"size"`
	SHA256  string   `json:"sha256"`
	Extents []Extent `json:"extents"`
	// Data is the bytes of its non-zero pages.
	Data int64 `json:"data"`
	// Layout: the file's data extents are part of what it says (a delta layer holds a
	// page, zeros too, to override its lineage's): fetch and write exactly them.
	Layout bool `json:"layout,omitempty"`
}

// Extent is a byte range of a file: Len bytes at Off.
type Extent struct {
	Off int64 `json:"off"`
	Len int64 `json:"len"`
}

// PullRequest is the body of POST /v1/checkpoints/pull: the daemon pulls checkpoint
// Checkpoint from the daemon at From (its TCP API, "http://host:port"), authenticated
// with Token; or, when From is a name (no "://"), from that node of the daemon's fleet
// with the fleet's credentials (Token unused; 409 no_fleet from a daemon in none).
type PullRequest struct {
	Checkpoint string `json:"checkpoint"`
	From       string `json:"from"`
	Token      string `json:"token,omitempty"`
	// ProgressTimeoutMS bounds how long the holder may send nothing (no response
	// header, no byte of a body) before the pull fails (0: DefaultPullProgressTimeout).
	ProgressTimeoutMS int64 `json:"progress_timeout_ms,omitempty"`
}

// DefaultPullProgressTimeout is how long a pull waits for a byte from its holder before
// it fails (a stalled holder must not hang the puller).
const DefaultPullProgressTimeout = 60 * time.Second

// ProgressTimeout is req's progress deadline: DefaultPullProgressTimeout for 0,
// ErrInvalidSpec for a negative one.
func (req PullRequest) ProgressTimeout() (time.Duration, error) {
	switch {
	case req.ProgressTimeoutMS < 0 || req.ProgressTimeoutMS > math.MaxInt64/int64(time.Millisecond):
		return 0, fmt.Errorf("%w: progress timeout %d ms", ErrInvalidSpec, req.ProgressTimeoutMS)
	case req.ProgressTimeoutMS == 0:
		return DefaultPullProgressTimeout, nil
	}
	return time.Duration(req.ProgressTimeoutMS) * time.Millisecond, nil
}

// PullResult is what a pull did: the checkpoint's info, the bytes that crossed the
// network, the files fetched and those the host already had (by digest), and whether
// the checkpoint was there already (then nothing was fetched).
type PullResult struct {
	Checkpoint   CheckpointInfo `json:"checkpoint"`
	Present      bool           `json:"present,omitempty"`
	Bytes        int64          `json:"bytes"`
	FilesFetched int            `json:"files_fetched"`
	FilesSkipped int            `json:"files_skipped"`
	Seconds      float64        `json:"seconds"`
}
