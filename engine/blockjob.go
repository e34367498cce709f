package engine

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/forkvm/forkvm/qmp"
)

// Every block-graph and block-job verb forkvm sends to QEMU is here, with typed
// arguments and results (qapi/block-core.json):
//
//   - blockStream: block-stream, copy a sub-chain into the active layer (asynchronous);
//   - queryBlockJobs, waitBlockJob: the jobs and their status, polled until concluded;
//   - blockJobDismiss, blockJobCancel: end a job's life, or stop it;
//   - queryChainDepth: how many backing files the guest's disk has right now;
//   - queryNodeNames, blockdevDel: the named nodes, and removing one nothing uses.
//
// The disk freeze's blockdev-add and blockdev-snapshot are in disk.go.

// streamArgs are the arguments of block-stream. Stream jobs are started with
// auto-dismiss off, so that their outcome stays visible (query-block-jobs) until the
// engine, or the next engine after a crash, has read it and dismissed the job.
type streamArgs struct {
	JobID string `json:"job-id"`
	// Device is the node the data is copied into (the guest's active layer).
	Device string `json:"device"`
	// BaseNode is the node whose data (and its backing chain's) is not copied; on
	// completion it becomes Device's backing node.
	BaseNode    string `json:"base-node"`
	AutoDismiss bool   `json:"auto-dismiss"`
	// OnError "report": an I/O error ends the job with an error, the chain unchanged.
	OnError string `json:"on-error,omitempty"`
}

// blockStream starts a stream job. It returns once QEMU started it.
func blockStream(ctx context.Context, c *qmp.Client, a streamArgs) error {
	if err := c.Execute(ctx, "block-stream", a, nil); err != nil {
		return fmt.Errorf("block-stream: %w", err)
	}
	return nil
}

// blockJobInfo is QEMU's BlockJobInfo, the members we read.
type blockJobInfo struct {
	Type   string `json:"type"`
	ID     string `json:"device"` // the job id (named "device" for history's sake)
	Len    int64  `json:"len"`
	Offset int64  `json:"offset"`
	Status string `json:"status"` // JobStatus: created, running, ..., concluded, null
	// Error is set when a concluded job did not complete successfully.
	Error string `json:"error,omitempty"`
}

// concluded reports whether the job finished all its work (successfully or not) and
// waits to be dismissed.
func (j blockJobInfo) concluded() bool { return j.Status == "concluded" || j.Status == "null" }

// queryBlockJobs lists the block jobs of a QEMU.
func queryBlockJobs(ctx context.Context, c *qmp.Client) ([]blockJobInfo, error) {
	var jobs []blockJobInfo
	if err := c.Execute(ctx, "query-block-jobs", nil, &jobs); err != nil {
		return nil, fmt.Errorf("query-block-jobs: %w", err)
	}
	return jobs, nil
}

// errNoSuchJob is waitBlockJob's answer for a job QEMU does not list (never started,
// or already dismissed).
var errNoSuchJob = errors.New("no such block job")

// waitBlockJob polls query-block-jobs until job id concluded and returns its last
// status. A job QEMU does not list yields errNoSuchJob. Ending ctx ends the wait, not
// the job: QEMU goes on with it, and its outcome is read later.
func waitBlockJob(ctx context.Context, c *qmp.Client, id string) (blockJobInfo, error) {
	delay := 200 * time.Microsecond
	for {
		jobs, err := queryBlockJobs(ctx, c)
		if err != nil {
			return blockJobInfo{}, err
		}
		found := false
		for _, j := range jobs {
			if j.ID != id {
				continue
			}
			found = true
			if j.concluded() {
				return j, nil
			}
		}
		if !found {
			return blockJobInfo{}, fmt.Errorf("%w: %s", errNoSuchJob, id)
		}
		select {
		case <-ctx.Done():
			return blockJobInfo{}, ctx.Err()
		case <-time.After(delay):
		}
		if delay < 10*time.Millisecond {
			delay *= 2
		}
	}
}

// blockJobDismiss removes a concluded job from QEMU's list.
func blockJobDismiss(ctx context.Context, c *qmp.Client, id string) error {
	if err := c.Execute(ctx, "block-job-dismiss", map[string]string{"id": id}, nil); err != nil {
		return fmt.Errorf("block-job-dismiss: %w", err)
	}
	return nil
}

// blockJobCancel asks QEMU to stop a job; a cancelled stream leaves the chain as it
// was (the data it copied so far stays in the active layer, where it changes nothing).
func blockJobCancel(ctx context.Context, c *qmp.Client, id string) error {
	if err := c.Execute(ctx, "block-job-cancel", map[string]string{"device": id}, nil); err != nil {
		return fmt.Errorf("block-job-cancel: %w", err)
	}
	return nil
}

// blockInfo is QEMU's BlockInfo, the members we read.
type blockInfo struct {
	Inserted *struct {
		NodeName string `json:"node-name"`
		// BackingDepth is the number of files in the backing chain (0: none).
		BackingDepth int `json:"backing_file_depth"`
	} `json:"inserted"`
}

// queryChainDepth returns the number of backing files below node, a guest drive's
// active layer, as QEMU has them now; ok is false when no drive has node on top (a
// block job's filter node sits there while the job runs).
func queryChainDepth(ctx context.Context, c *qmp.Client, node string) (depth int, ok bool, err error) {
	var blocks []blockInfo
	if err := c.Execute(ctx, "query-block", nil, &blocks); err != nil {
		return 0, false, fmt.Errorf("query-block: %w", err)
	}
	for _, b := range blocks {
		if b.Inserted != nil && b.Inserted.NodeName == node {
			return b.Inserted.BackingDepth, true, nil
		}
	}
	return 0, false, nil
}

// queryNodeNames returns the names of QEMU's named block nodes (flat: without their
// backing chains).
func queryNodeNames(ctx context.Context, c *qmp.Client) ([]string, error) {
	var nodes []struct {
		NodeName string `json:"node-name"`
	}
	if err := c.Execute(ctx, "query-named-block-nodes", map[string]bool{"flat": true}, &nodes); err != nil {
		return nil, fmt.Errorf("query-named-block-nodes: %w", err)
	}
	out := make([]string, 0, len(nodes))
	for _, n := range nodes {
		out = append(out, n.NodeName)
	}
	return out, nil
}

// blockdevDel removes a node the monitor owns (made by -blockdev or blockdev-add); QEMU
// refuses while anything still uses it.
func blockdevDel(ctx context.Context, c *qmp.Client, node string) error {
	if err := c.Execute(ctx, "blockdev-del", map[string]string{"node-name": node}, nil); err != nil {
		return fmt.Errorf("blockdev-del %s: %w", node, err)
	}
	return nil
}
