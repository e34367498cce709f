// Package pull copies a checkpoint from another forkvm daemon into a local engine: the
// holder's export (its relocatable manifest and files with digests and data extents)
// over its HTTP API, each file's data extents by Range requests (holes are never sent
// and stay holes), every file checked against its digest before the checkpoint is
// committed (engine.ErrDigest otherwise, leaving nothing), files the host already has
// by digest (boot files, base images) skipped.
//
// A fleet node fetching a checkpoint from a holder calls
//
//	res, err := pull.Checkpoint(ctx, e, pull.Remote(holderURL, token), name, nil)
//
// (a *client.Client of the holder is a Source too; this package does not link the
// client, so that the daemon, whose tests the client's use, can pull).
package pull

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
	"github.com/forkvm/forkvm/memfile"
)

// Source is a daemon holding checkpoints; a *client.Client of its TCP API is one.
type Source interface {
	ExportCheckpoint(ctx context.Context, name string) (*api.CheckpointExport, error)
	ReadCheckpointFile(ctx context.Context, name, file string, off, n int64) (io.ReadCloser, error)
}

// RangesSource is a Source that also reads several ranges of a file in one request.
// A RAM layer's data lies in hundreds of runs of pages that no gap may join (see
// fetchFile), so a request per run made every pull of a layer hundreds of round trips,
// each of which has the holder open the checkpoint again.
type RangesSource interface {
	Source
	// ReadCheckpointFileRanges calls each with every range of rs, in order, and a reader
	// of that range's bytes; each must read them all. It stops at each's first error.
	ReadCheckpointFileRanges(ctx context.Context, name, file string, rs []api.Extent, each func(api.Extent, io.Reader) error) error
}

// maxParts bounds the ranges of one request to a RangesSource (its Range header stays
// within a few KiB).
const maxParts = 256

// Options tune a pull. A nil *Options means defaults.
type Options struct {
	// MaxRange bounds one Range request (default 64 MiB); extents closer than MaxGap
	// (default 1 MiB) are fetched in one request, their gap with them (zeros, not
	// written).
	MaxRange, MaxGap int64
	// ProgressTimeout bounds every remote read (the export, each range): the holder
	// sending nothing, not even a response, for this long fails the pull with
	// ErrStalled (default api.DefaultPullProgressTimeout; negative is ErrInvalidSpec).
	ProgressTimeout time.Duration
}

// Checkpoint pulls checkpoint name from the daemon src into e (see the package
// comment). Errors: the holder's (engine.ErrNotFound, ...), engine.ErrExists when e has
// another checkpoint of that name, engine.ErrIncompatible when e's QEMU or accelerator
// differs, engine.ErrDigest when a file arrived other than its holder recorded it.
func Checkpoint(ctx context.Context, e *engine.Engine, src Source, name string, opts *Options) (*api.PullResult, error) {
	o := Options{MaxRange: 64 << 20, MaxGap: 1 << 20, ProgressTimeout: api.DefaultPullProgressTimeout}
	if opts != nil {
		if opts.MaxRange > 0 {
			o.MaxRange = opts.MaxRange
		}
		if opts.MaxGap >= 0 {
			o.MaxGap = opts.MaxGap
		}
		if opts.ProgressTimeout < 0 {
			return nil, fmt.Errorf("%w: pull: progress timeout %v", api.ErrInvalidSpec, opts.ProgressTimeout)
		}
		if opts.ProgressTimeout > 0 {
			o.ProgressTimeout = opts.ProgressTimeout
		}
	}
	if err := engine.ValidateName(name); err != nil {
		return nil, err
	}
	t0 := time.Now()
	ectx, wd := watch(ctx, o.ProgressTimeout)
	exp, err := src.ExportCheckpoint(ectx, name)
	wd.stop()
	if err != nil {
		return nil, fmt.Errorf("pull %s: export: %w", name, stalled(ectx, err))
	}
	if exp.Checkpoint != name {
		return nil, fmt.Errorf("%w: pull %s: the holder exported %q", engine.ErrCheckpointCorrupt, name, exp.Checkpoint)
	}
	imp, err := e.ImportCheckpoint(ctx, exp)
	if err != nil {
		return nil, err
	}
	res := &api.PullResult{}
	if !imp.Present {
		defer imp.Abort()
		for _, f := range imp.Fetch() {
			n, err := fetchFile(ctx, imp, src, name, f, o)
			res.Bytes += n
			if err != nil {
				return nil, err
			}
			res.FilesFetched++
		}
		res.FilesSkipped = imp.Skipped()
	} else {
		res.Present = true
	}
	c, err := imp.Commit(ctx)
	if err != nil {
		return nil, err
	}
	info, err := e.CheckpointInfo(c.Name())
	if err != nil {
		return nil, err
	}
	res.Checkpoint = info
	res.Seconds = time.Since(t0).Seconds()
	return res, nil
}

// fetchFile transfers one file's data extents and returns the bytes that crossed.
func fetchFile(ctx context.Context, imp *engine.CheckpointImport, src Source, name string, f api.CheckpointFile, o Options) (int64, error) {
	w, err := imp.Create(f.Name)
	if err != nil {
		return 0, err
	}
	var total int64
	gap := o.MaxGap
	if f.Layout {
		gap = -1 // its extents are its content: never fetch a gap with them
	}
	rs := ranges(f.Extents, o.MaxRange, gap)
	multi, _ := src.(RangesSource)
	for len(rs) > 0 {
		var n int64
		var err error
		if k := batch(rs, o.MaxRange); multi != nil && k > 1 {
			n, err = fetchRanges(ctx, w, multi, name, f.Name, rs[:k], o.ProgressTimeout)
			rs = rs[k:]
		} else {
			n, err = fetchRange(ctx, w, src, name, f.Name, rs[0], o.ProgressTimeout)
			rs = rs[1:]
		}
		total += n
		if err != nil {
			w.Close()
			return total, fmt.Errorf("pull %s: %s: %w", name, f.Name, err)
		}
	}
	if err := w.Close(); err != nil {
		if errors.Is(err, engine.ErrDigest) {
			return total, fmt.Errorf("pull %s: %w", name, err)
		}
		return total, err
	}
	return total, nil
}

// fetchRange fetches and writes one range of a file under a watchdog of d (each byte
// received starts it again) and returns the bytes that crossed.
func fetchRange(ctx context.Context, w *engine.FileWriter, src Source, name, file string, r api.Extent, d time.Duration) (int64, error) {
	rctx, wd := watch(ctx, d)
	defer wd.stop()
	body, err := src.ReadCheckpointFile(rctx, name, file, r.Off, r.Len)
	if err != nil {
		return 0, stalled(rctx, err)
	}
	defer body.Close()
	cr := &countingReader{r: progressReader{r: body, touch: wd.touch}}
	if err := w.WriteRange(rctx, r.Off, r.Len, cr); err != nil {
		return cr.n, stalled(rctx, err)
	}
	return cr.n, nil
}

// fetchRanges is fetchRange for several ranges in one request.
func fetchRanges(ctx context.Context, w *engine.FileWriter, src RangesSource, name, file string, rs []api.Extent, d time.Duration) (int64, error) {
	rctx, wd := watch(ctx, d)
	defer wd.stop()
	var total int64
	err := src.ReadCheckpointFileRanges(rctx, name, file, rs, func(r api.Extent, body io.Reader) error {
		cr := &countingReader{r: progressReader{r: body, touch: wd.touch}}
		err := w.WriteRange(rctx, r.Off, r.Len, cr)
		total += cr.n
		return err
	})
	if err != nil {
		return total, stalled(rctx, err)
	}
	return total, nil
}

// batch is how many of rs, from the first, one multi-range request asks for: at most
// maxParts ranges and maxBytes bytes (at least one range).
func batch(rs []api.Extent, maxBytes int64) int {
	var sum int64
	for i, r := range rs {
		if i == maxParts || (i > 0 && sum+r.Len > maxBytes) {
			return i
		}
		sum += r.Len
	}
	return len(rs)
}

// countingReader counts the bytes read through it.
type countingReader struct {
	r io.Reader
	n int64
}

func (c *countingReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.n += int64(n)
	return n, err
}

// ranges groups extents into Range requests of at most maxRange bytes, joining extents
// less than maxGap apart (an extent longer than maxRange is split at page boundaries).
func ranges(exts []api.Extent, maxRange, maxGap int64) []api.Extent {
	maxRange = max(maxRange&^(memfile.PageSize-1), memfile.PageSize)
	var out []api.Extent
	for _, x := range exts {
		for x.Len > 0 {
			if n := len(out); n > 0 {
				last := &out[n-1]
				end := last.Off + last.Len
				if maxGap >= 0 && x.Off-end <= maxGap && x.Off+x.Len-last.Off <= maxRange {
					last.Len = x.Off + x.Len - last.Off
					break
				}
			}
			k := min(x.Len, maxRange)
			out = append(out, api.Extent{Off: x.Off, Len: k})
			x.Off, x.Len = x.Off+k, x.Len-k
		}
	}
	return out
}
