package client

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"syscall"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/tarstream"
)

// Daemon describes the daemon (GET /v1/info).
func (c *Client) Daemon(ctx context.Context) (api.DaemonObject, bool, error) {
	var d api.DaemonObject
	err := c.call(ctx, http.MethodGet, "/v1/info", nil, &d)
	return d, err == nil, err
}

// Reap deletes every VM whose QEMU is gone (api.Engine.Reap).
func (c *Client) Reap(ctx context.Context) ([]string, error) {
	var r api.ReapResponse
	err := c.call(ctx, http.MethodPost, "/v1/reap", struct{}{}, &r)
	return r.Removed, err
}

func ckPath(name string) string { return "/v1/checkpoints/" + url.PathEscape(name) }

// GetCheckpoint returns one checkpoint with its live forks.
func (c *Client) GetCheckpoint(ctx context.Context, name string) (api.CheckpointInfo, error) {
	var o api.CheckpointObject
	err := c.call(ctx, http.MethodGet, ckPath(name), nil, &o)
	return o.CheckpointInfo, err
}

// SetPinned pins or unpins a checkpoint (api.Engine.SetPinned).
func (c *Client) SetPinned(ctx context.Context, name string, pinned bool) error {
	return c.call(ctx, http.MethodPatch, ckPath(name), api.CheckpointPatch{Pinned: &pinned}, nil)
}

// Budget returns the daemon engine's vCPU admission budget (api.Engine.Budget).
func (c *Client) Budget(ctx context.Context) (api.Budget, error) {
	var b api.Budget
	err := c.call(ctx, http.MethodGet, "/v1/budget", nil, &b)
	return b, err
}

// Warm keeps n pooled processes for checkpoint ck in the daemon (api.Engine.Warm).
func (c *Client) Warm(ctx context.Context, ck string, n int, opts *api.WarmOptions) error {
	req := api.PoolRequest{N: n}
	if opts != nil {
		req.Restored, req.WarmUp = opts.Restored, opts.WarmUp
	}
	return c.call(ctx, http.MethodPut, ckPath(ck)+"/pool", req, nil)
}

// PoolSize returns how many pooled processes checkpoint ck has (api.Engine.PoolSize).
func (c *Client) PoolSize(ctx context.Context, ck string) (int, error) {
	var p api.PoolObject
	err := c.call(ctx, http.MethodGet, ckPath(ck)+"/pool", nil, &p)
	return p.Size, err
}

func filesPath(name, op, p string) string {
	return vmPath(name) + "/" + op + "?path=" + url.QueryEscape(p)
}

// CopyIn extracts the tar stream r into the guest directory dir (api.VM.CopyIn); r
// is streamed, not buffered.
func (c *Client) CopyIn(ctx context.Context, name, dir string, r io.Reader) error {
	resp, err := c.doBody(ctx, http.MethodPut, filesPath(name, "files", dir), "application/x-tar", r)
	if err != nil {
		return err
	}
	resp.Body.Close()
	return nil
}

// CopyInPath copies the host path hostPath into the guest directory guestDir under
// its base name (api.API.CopyInPath): this program archives it and streams it to the
// daemon.
func (c *Client) CopyInPath(ctx context.Context, name, hostPath, guestDir string) error {
	return tarstream.CopyInPath(ctx, hostPath, func(r io.Reader) error { return c.CopyIn(ctx, name, guestDir, r) })
}

// CopyOut writes the guest path p as a tar stream to w (api.VM.CopyOut). A transfer
// the daemon cuts short fails (the daemon aborts the connection).
func (c *Client) CopyOut(ctx context.Context, name, p string, w io.Writer) error {
	resp, err := c.do(ctx, http.MethodGet, filesPath(name, "files", p), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if _, err := io.Copy(w, resp.Body); err != nil {
		return fmt.Errorf("client: copy out %s: %w", p, err)
	}
	return nil
}

// Stat returns a guest path's attributes; a missing path matches fs.ErrNotExist.
func (c *Client) Stat(ctx context.Context, name, p string) (fs.FileInfo, error) {
	var st api.FileStat
	if err := c.call(ctx, http.MethodGet, filesPath(name, "stat", p), nil, &st); err != nil {
		return nil, err
	}
	return st.FileInfo(), nil
}

// Logs writes the VM's serial console to w (api.VM.Logs); with follow it streams
// until the VM's QEMU exits or ctx ends (ctx's error).
func (c *Client) Logs(ctx context.Context, name string, follow bool, w io.Writer) error {
	resp, err := c.do(ctx, http.MethodGet, vmPath(name)+"/logs?follow="+strconv.FormatBool(follow), nil)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(w, resp.Body)
	if err != nil && ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// Start starts a command in the VM name as an attached exec (docs/api.md): the
// connection is taken over and carries req.Stdin to the command, its output back to
// req.Stdout/req.Stderr, and Signal and Resize. ctx bounds the start only; Wait's ctx
// bounds the rest. A start failure is returned as from api.VM.Start (errors.Is
// matches vsockd.ErrNotFound for a missing command, ...).
func (c *Client) Start(ctx context.Context, name string, req *api.ExecRequest) (Process, error) {
	b, err := json.Marshal(execBody(req))
	if err != nil {
		return nil, err
	}
	// The request's context must outlive the start: cancelling it would close the
	// connection the process runs on. ctx still bounds the start through stop.
	rctx, cancelReq := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancelReq)
	hreq, err := http.NewRequestWithContext(rctx, http.MethodPost, c.base+vmPath(name)+"/exec", bytes.NewReader(b))
	if err != nil {
		cancelReq()
		return nil, err
	}
	hreq.Header.Set("Content-Type", "application/json")
	hreq.Header.Set("Connection", "Upgrade")
	hreq.Header.Set("Upgrade", api.ExecUpgrade)
	if c.token != "" {
		hreq.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(hreq)
	if !stop() || err != nil {
		cancelReq()
		if resp != nil {
			resp.Body.Close()
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, err
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		cancelReq()
		defer resp.Body.Close()
		return nil, decodeError(resp)
	}
	conn, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		cancelReq()
		resp.Body.Close()
		return nil, errors.New("client: attached exec: the daemon's 101 response is not writable")
	}
	p := &process{conn: conn, cancel: cancelReq, done: make(chan struct{})}
	go p.read(req, resp.StatusCode)
	go p.feed(req.Stdin)
	return p, nil
}

// process is an attached exec. Design: one goroutine reads the daemon's lines (output,
// then the result) and one copies stdin; writers of input lines (stdin, Signal, Resize)
// share the connection under wmu. Wait closes the connection when its ctx ends, which
// the daemon answers by killing the command.
type process struct {
	conn   io.ReadWriteCloser
	cancel context.CancelFunc
	wmu    sync.Mutex
	done   chan struct{}
	code   int
	err    error
}

func (p *process) send(in api.ExecInput) error {
	b, err := json.Marshal(in)
	if err != nil {
		return err
	}
	p.wmu.Lock()
	defer p.wmu.Unlock()
	_, err = p.conn.Write(append(b, '\n'))
	return err
}

func (p *process) read(req *api.ExecRequest, status int) {
	p.code, p.err = readExecLines(p.conn, req, status)
	close(p.done)
	p.conn.Close()
	p.cancel()
}

// feed sends stdin in chunks, then stdin_eof; nil stdin is an empty one. As with
// os/exec and non-file readers, a Read blocked in r is not interrupted when the command
// ends.
func (p *process) feed(r io.Reader) {
	if r != nil {
		buf := make([]byte, 32<<10)
		for {
			n, err := r.Read(buf)
			if n > 0 {
				if p.send(api.ExecInput{Stdin: bytes.Clone(buf[:n])}) != nil {
					return
				}
			}
			if err != nil {
				break
			}
		}
	}
	p.send(api.ExecInput{StdinEOF: true})
}

func (p *process) Wait(ctx context.Context) (int, error) {
	select {
	case <-p.done:
		return p.code, p.err
	case <-ctx.Done():
		p.conn.Close() // the daemon kills the command
		<-p.done
		return -1, ctx.Err()
	}
}

func (p *process) Signal(ctx context.Context, sig syscall.Signal) error {
	return p.sendCtx(ctx, api.ExecInput{Signal: int(sig)})
}

func (p *process) Resize(ctx context.Context, rows, cols uint16) error {
	return p.sendCtx(ctx, api.ExecInput{Resize: &api.ResizeSize{Rows: rows, Cols: cols}})
}

// sendCtx sends a control line unless ctx has ended or the command is done.
func (p *process) sendCtx(ctx context.Context, in api.ExecInput) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case <-p.done:
		return errors.New("client: attached exec: the command has ended")
	default:
	}
	return p.send(in)
}
