package qemu

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// The block-graph and block-job verbs (qapi/block-core.json).

// BlockdevFile is a file protocol node (driver "file").
type BlockdevFile struct {
	Filename string `json:"filename"`
}

// MarshalJSON writes the node with its driver.
func (f BlockdevFile) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Driver   string `json:"driver"`
		Filename string `json:"filename"`
	}{"file", f.Filename})
}

// BlockdevQcow2 are the arguments of a blockdev-add of a qcow2 node over a file, with
// no backing node: blockdev-snapshot gives it one.
type BlockdevQcow2 struct {
	NodeName string       `json:"node-name"`
	File     BlockdevFile `json:"file"`
	// Discard "unmap" passes the guest's discards down to the file.
	Discard string `json:"discard,omitempty"`
}

// MarshalJSON writes the node with driver qcow2 and an explicit null backing (QEMU
// would otherwise open the backing file named in the qcow2 header).
func (b BlockdevQcow2) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Driver   string       `json:"driver"`
		NodeName string       `json:"node-name"`
		Discard  string       `json:"discard,omitempty"`
		Cache    blockCache   `json:"cache"`
		File     BlockdevFile `json:"file"`
		Backing  *struct{}    `json:"backing"`
	}{"qcow2", b.NodeName, b.Discard, blockCache{NoFlush: true}, b.File, nil})
}

// blockCache is a node's cache options: NoFlush, the flushes of a guest's writes (and
// of every stop) end in the host's page cache (see BlockdevJSON).
type blockCache struct {
	NoFlush bool `json:"no-flush"`
}

// BlockdevAdd adds a qcow2 node (over its file, without backing) to the block graph.
func (m *Monitor) BlockdevAdd(ctx context.Context, b BlockdevQcow2) error {
	return m.exec(ctx, "blockdev-add", b, nil)
}

// BlockdevDel removes a node the monitor owns (made by -blockdev or blockdev-add);
// QEMU refuses while anything still uses it.
func (m *Monitor) BlockdevDel(ctx context.Context, node string) error {
	if err := m.c.Execute(ctx, "blockdev-del", struct {
		NodeName string `json:"node-name"`
	}{node}, nil); err != nil {
		return fmt.Errorf("blockdev-del %s: %w", node, err)
	}
	return nil
}

// BlockdevSetActive activates (or inactivates) every block node. After a completed
// outgoing migration QEMU has inactivated them (handing them to a destination); they
// must be taken back before the graph changes.
func (m *Monitor) BlockdevSetActive(ctx context.Context, active bool) error {
	return m.exec(ctx, "blockdev-set-active", struct {
		Active bool `json:"active"`
	}{active}, nil)
}

// BlockdevSnapshot puts overlay (a node without backing) on top of node: the guest's
// drive writes to overlay from now on, and node becomes its read-only backing.
func (m *Monitor) BlockdevSnapshot(ctx context.Context, node, overlay string) error {
	return m.exec(ctx, "blockdev-snapshot", struct {
		Node    string `json:"node"`
		Overlay string `json:"overlay"`
	}{node, overlay}, nil)
}

// BlockStreamArgs are the arguments of block-stream. AutoDismiss is sent as given
// (false by default, unlike QEMU's default), so a job's outcome stays visible
// (QueryBlockJobs) until the engine, or the next engine after a crash, has read it
// and dismissed the job.
type BlockStreamArgs struct {
	JobID string `json:"job-id"`
	// Device is the node the data is copied into (the guest's active layer).
	Device string `json:"device"`
	// BaseNode is the node whose data (and its backing chain's) is not copied; on
	// completion it becomes Device's backing node.
	BaseNode    string `json:"base-node"`
	AutoDismiss bool   `json:"auto-dismiss"`
	// OnError "report": an I/O error ends the job with an error, the chain unchanged.
	OnError string `json:"on-error,omitempty"`
	// BackingFile, if set, is the backing name written into Device's header on
	// completion (QEMU writes BaseNode's file name otherwise: an absolute path).
	BackingFile string `json:"backing-file,omitempty"`
}

// BlockStream starts a stream job, copying a sub-chain into the active layer. It
// returns once QEMU started it.
func (m *Monitor) BlockStream(ctx context.Context, a BlockStreamArgs) error {
	return m.exec(ctx, "block-stream", a, nil)
}

// BlockJobInfo is QEMU's BlockJobInfo, the members forkvm reads.
type BlockJobInfo struct {
	Type   string `json:"type"`
	ID     string `json:"device"` // the job id (named "device" for history's sake)
	Len    int64  `json:"len"`
	Offset int64  `json:"offset"`
	Status string `json:"status"` // JobStatus: created, running, ..., concluded, null
	// Error is set when a concluded job did not complete successfully.
	Error string `json:"error,omitempty"`
}

// Concluded reports whether the job finished all its work (successfully or not) and
// waits to be dismissed.
func (j BlockJobInfo) Concluded() bool { return j.Status == "concluded" || j.Status == "null" }

// QueryBlockJobs lists the block jobs of the QEMU.
func (m *Monitor) QueryBlockJobs(ctx context.Context) ([]BlockJobInfo, error) {
	var jobs []BlockJobInfo
	if err := m.exec(ctx, "query-block-jobs", nil, &jobs); err != nil {
		return nil, err
	}
	return jobs, nil
}

// ErrNoSuchJob is WaitBlockJob's answer for a job QEMU does not list (never started,
// or already dismissed).
var ErrNoSuchJob = errors.New("no such block job")

// WaitBlockJob polls query-block-jobs until job id concluded and returns its last
// status. A job QEMU does not list yields ErrNoSuchJob. Ending ctx ends the wait, not
// the job: QEMU goes on with it, and its outcome can be read later.
func (m *Monitor) WaitBlockJob(ctx context.Context, id string) (BlockJobInfo, error) {
	delay := 200 * time.Microsecond
	for {
		jobs, err := m.QueryBlockJobs(ctx)
		if err != nil {
			return BlockJobInfo{}, err
		}
		found := false
		for _, j := range jobs {
			if j.ID != id {
				continue
			}
			found = true
			if j.Concluded() {
				return j, nil
			}
		}
		if !found {
			return BlockJobInfo{}, fmt.Errorf("%w: %s", ErrNoSuchJob, id)
		}
		select {
		case <-ctx.Done():
			return BlockJobInfo{}, ctx.Err()
		case <-time.After(delay):
		}
		if delay < 10*time.Millisecond {
			delay *= 2
		}
	}
}

// BlockJobDismiss removes a concluded job from QEMU's list.
func (m *Monitor) BlockJobDismiss(ctx context.Context, id string) error {
	return m.exec(ctx, "block-job-dismiss", struct {
		ID string `json:"id"`
	}{id}, nil)
}

// BlockInfo is QEMU's BlockInfo (one guest drive), the members forkvm reads.
type BlockInfo struct {
	// IOStatus is "ok", "failed" or "nospace" (drives with werror/rerror stop).
	IOStatus string `json:"io-status,omitempty"`
	// Inserted is the drive's medium: its active node; nil for an empty drive.
	Inserted *BlockDeviceInfo `json:"inserted"`
}

// BlockDeviceInfo is QEMU's BlockDeviceInfo, the members forkvm reads.
type BlockDeviceInfo struct {
	NodeName string `json:"node-name"`
	// BackingFileDepth is the number of files in the backing chain (0: none).
	BackingFileDepth int `json:"backing_file_depth"`
}

// QueryBlock lists the guest's drives.
func (m *Monitor) QueryBlock(ctx context.Context) ([]BlockInfo, error) {
	var blocks []BlockInfo
	if err := m.exec(ctx, "query-block", nil, &blocks); err != nil {
		return nil, err
	}
	return blocks, nil
}

// ChainDepth returns the number of backing files below node, a guest drive's active
// layer, as QEMU has them now; ok is false when no drive has node on top (a block
// job's filter node sits there while the job runs).
func (m *Monitor) ChainDepth(ctx context.Context, node string) (depth int, ok bool, err error) {
	blocks, err := m.QueryBlock(ctx)
	if err != nil {
		return 0, false, err
	}
	for _, b := range blocks {
		if b.Inserted != nil && b.Inserted.NodeName == node {
			return b.Inserted.BackingFileDepth, true, nil
		}
	}
	return 0, false, nil
}

// QueryNodeNames returns the names of QEMU's named block nodes
// (query-named-block-nodes, flat: without their backing chains).
func (m *Monitor) QueryNodeNames(ctx context.Context) ([]string, error) {
	var nodes []BlockDeviceInfo
	if err := m.exec(ctx, "query-named-block-nodes", struct {
		Flat bool `json:"flat"`
	}{true}, &nodes); err != nil {
		return nil, err
	}
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n.NodeName)
	}
	return out, nil
}

// BlockIOError is the data of QEMU's BLOCK_IO_ERROR event.
type BlockIOError struct {
	Device    string `json:"device"`
	NodeName  string `json:"node-name"`
	Operation string `json:"operation"`
	Action    string `json:"action"` // "ignore", "report" or "stop"
	NoSpace   bool   `json:"nospace"`
	Reason    string `json:"reason"`
}
