// Package client is the Go client of forkvm's daemon (`forkvm serve`, package serve):
// a *Client implements api.API over the daemon's HTTP API. Its methods take and return
// package api's types, which the engine uses under its own names (engine.Info is
// api.Info, vsockd.ExecRequest is api.ExecRequest), and its errors match the engine's
// sentinels with errors.Is (and *engine.AdmissionError, which is *api.AdmissionError,
// with errors.As), so code written against the engine moves to a daemon with little
// change. VMs are returned as api.Info values, not *engine.VM handles.
//
// It links neither the engine nor the guest agent's protocol: a program that only
// talks to a daemon, on this host or another, imports this package and api.
// Package serve/local is the in-process implementation of api.API and holds Open,
// which picks a daemon when one answers and the engine otherwise.
package client

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/forkvm/forkvm/api"
)

// Client talks to one daemon. It is safe for concurrent use.
type Client struct {
	base  string // scheme://host, no trailing slash
	token string
	hc    *http.Client
}

// New returns a client of the daemon listening on the unix socket path (a daemon of the
// state directory DIR listens on DIR/forkvm.sock: api.SocketPath).
func New(socket string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socket)
		},
		// Clients often run many execs at once: keep a connection for each (a local
		// daemon's connections are cheap).
		MaxIdleConnsPerHost: 256,
		IdleConnTimeout:     30 * time.Second,
	}
	return &Client{base: "http://forkvm", hc: &http.Client{Transport: tr}}
}

// NewTCP returns a client of a daemon's TCP listener (baseURL like
// "http://127.0.0.1:7070") sending token as a bearer token.
func NewTCP(baseURL, token string) *Client {
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.MaxIdleConnsPerHost = 256 // the default (2) redials under concurrent execs
	return &Client{base: strings.TrimRight(baseURL, "/"), token: token, hc: &http.Client{Transport: tr}}
}

// Close releases idle connections.
func (c *Client) Close() error {
	c.hc.CloseIdleConnections()
	return nil
}

// Error is an error answered by the daemon. It unwraps to the engine (or agent) sentinel
// its code stands for (api.SentinelOf), or for code "admission" to an
// *api.AdmissionError with the refusal's figures.
type Error struct {
	Status int
	api.ErrorObject
}

func (e *Error) Error() string {
	if e.Message != "" {
		return e.Message
	}
	return fmt.Sprintf("forkvm daemon: %s (HTTP %d)", e.Code, e.Status)
}

// Unwrap returns the error the code stands for.
func (e *Error) Unwrap() error {
	if e.Code == api.CodeAdmission {
		return &api.AdmissionError{Resource: e.Resource, Requested: e.Requested, Available: e.Available, Budget: e.Budget}
	}
	return api.SentinelOf(e.Code)
}

func errorFrom(status int, o api.ErrorObject) error { return &Error{Status: status, ErrorObject: o} }

// eventError is a failed fork event's error, an admission refusal's figures kept.
func eventError(status int, o api.ForkEventObject) error {
	return errorFrom(status, api.ErrorObject{Code: o.Code, Message: o.Error,
		Resource: o.Resource, Requested: o.Requested, Available: o.Available, Budget: o.Budget})
}

// do sends a request with an optional JSON body and returns the response when its
// status is 2xx; otherwise it decodes the error.
func (c *Client) do(ctx context.Context, method, path string, body any) (*http.Response, error) {
	if body == nil {
		return c.doBody(ctx, method, path, "", nil)
	}
	b, err := json.Marshal(body)
	if err != nil {
		return nil, err
	}
	return c.doBody(ctx, method, path, "application/json", bytes.NewReader(b))
}

// doBody is do with a body of the given content type (nil: none), streamed as read.
func (c *Client) doBody(ctx context.Context, method, path, contentType string, body io.Reader) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, body)
	if err != nil {
		return nil, err
	}
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	if c.token != "" {
		req.Header.Set("Authorization", "Bearer "+c.token)
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode/100 == 2 {
		return resp, nil
	}
	defer resp.Body.Close()
	return nil, decodeError(resp)
}

// decodeError turns a non-2xx response into an *Error.
func decodeError(resp *http.Response) error {
	var er api.ErrorResponse
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20))
	if json.Unmarshal(b, &er) != nil || er.Error.Code == "" {
		return errorFrom(resp.StatusCode, api.ErrorObject{Code: api.CodeInternal,
			Message: fmt.Sprintf("forkvm daemon: HTTP %d: %s", resp.StatusCode, strings.TrimSpace(string(b)))})
	}
	return errorFrom(resp.StatusCode, er.Error)
}

// call does a request and decodes a JSON response into out (nil: discard).
func (c *Client) call(ctx context.Context, method, path string, body, out any) error {
	resp, err := c.do(ctx, method, path, body)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if out == nil {
		_, err = io.Copy(io.Discard, resp.Body)
		return err
	}
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		return err
	}
	drainBody(resp.Body) // the newline after the value and the end of the body
	return nil
}

// drainBody reads what is left of a response after its last line (the end of the
// chunked stream) so that the transport reuses the connection: net/http closes a
// connection whose body is closed before its end.
func drainBody(r io.Reader) { io.Copy(io.Discard, io.LimitReader(r, 4<<10)) }

func vmPath(name string) string { return "/v1/vms/" + url.PathEscape(name) }

// List returns all VMs, sorted by name (api.Engine.List).
func (c *Client) List(ctx context.Context) ([]api.Info, error) {
	var objs []api.VMObject
	if err := c.call(ctx, http.MethodGet, "/v1/vms", nil, &objs); err != nil {
		return nil, err
	}
	out := make([]api.Info, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.Info)
	}
	return out, nil
}

// Create boots a VM and returns once its agent answered (api.Engine.Create).
func (c *Client) Create(ctx context.Context, spec api.Spec) (api.Info, error) {
	var o api.VMObject
	err := c.call(ctx, http.MethodPost, "/v1/vms", spec, &o)
	return o.Info, err
}

// Get returns the named VM (api.Engine.Get, then VM.Info).
func (c *Client) Get(ctx context.Context, name string) (api.Info, error) {
	var o api.VMObject
	err := c.call(ctx, http.MethodGet, vmPath(name), nil, &o)
	return o.Info, err
}

// Delete stops and removes a VM (api.Engine.Delete).
func (c *Client) Delete(ctx context.Context, name string) error {
	return c.call(ctx, http.MethodDelete, vmPath(name), nil, nil)
}

// Memory measures a VM's host memory (api.VM.Memory).
func (c *Client) Memory(ctx context.Context, name string) (*api.MemoryUsage, error) {
	var mu api.MemoryUsage
	if err := c.call(ctx, http.MethodGet, vmPath(name)+"/memory", nil, &mu); err != nil {
		return nil, err
	}
	return &mu, nil
}

// Exec runs a command in the VM name and returns its exit code (api.VM.Exec).
// Output is copied to req.Stdout and req.Stderr as it arrives. Without stdin or a TTY it
// is one streamed POST; otherwise an attached exec (Start) that streams req.Stdin.
// Cancelling ctx disconnects, which ends the command in the guest.
func (c *Client) Exec(ctx context.Context, name string, req *api.ExecRequest) (int, error) {
	if req.Stdin != nil || req.TTY {
		p, err := c.Start(ctx, name, req)
		if err != nil {
			return api.StartErrorCode(err), err
		}
		return p.Wait(ctx)
	}
	body := execBody(req)
	resp, err := c.do(ctx, http.MethodPost, vmPath(name)+"/exec", body)
	if err != nil {
		return api.StartErrorCode(err), err
	}
	defer resp.Body.Close()
	code, err := readExecLines(resp.Body, req, resp.StatusCode)
	drainBody(resp.Body)
	if err != nil && ctx.Err() != nil {
		return -1, ctx.Err()
	}
	return code, err
}

// execBody is req's body. Its timeout is rounded up to whole milliseconds: rounded
// down, one under a millisecond became 0, no timeout at all. A negative one is none,
// as in api.ExecRequest (the daemon refuses a negative timeout_ms).
func execBody(req *api.ExecRequest) api.ExecBody {
	var ms int64
	if req.Timeout > 0 {
		ms = req.Timeout.Milliseconds()
		if req.Timeout%time.Millisecond != 0 && ms < math.MaxInt64/int64(time.Millisecond) {
			ms++
		}
	}
	return api.ExecBody{Argv: req.Argv, Env: req.Env, Workdir: req.Dir, User: req.User, MaxOutput: req.MaxOutput,
		TimeoutMS: ms, TTY: req.TTY, Rows: req.Rows, Cols: req.Cols, Term: req.Term}
}

// readExecLines copies an exec stream's output to req's writers and returns its exit
// code or error.
func readExecLines(r io.Reader, req *api.ExecRequest, status int) (int, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20) // a line holds at most one agent frame (1 MiB) in base64
	for sc.Scan() {
		var l api.ExecLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			return -1, fmt.Errorf("client: exec stream: %w", err)
		}
		switch {
		case l.Error != nil:
			return -1, errorFrom(status, *l.Error)
		case l.ExitCode != nil:
			return *l.ExitCode, nil
		case l.Stdout != nil:
			if req.Stdout != nil {
				if _, err := req.Stdout.Write(l.Stdout); err != nil {
					return -1, err
				}
			}
		case l.Stderr != nil:
			if req.Stderr != nil {
				if _, err := req.Stderr.Write(l.Stderr); err != nil {
					return -1, err
				}
			}
		}
	}
	if err := sc.Err(); err != nil {
		return -1, fmt.Errorf("client: exec stream: %w", err)
	}
	return -1, errors.New("client: exec stream ended without an exit code")
}

// Checkpoints lists checkpoints with their live forks (api.Engine.Checkpoints).
func (c *Client) Checkpoints(ctx context.Context) ([]api.CheckpointInfo, error) {
	var objs []api.CheckpointObject
	if err := c.call(ctx, http.MethodGet, "/v1/checkpoints", nil, &objs); err != nil {
		return nil, err
	}
	out := make([]api.CheckpointInfo, 0, len(objs))
	for _, o := range objs {
		out = append(out, o.CheckpointInfo)
	}
	return out, nil
}

// Checkpoint checkpoints the running VM vmName (api.Engine.Checkpoint); "" name:
// generated. A nil opts means defaults.
func (c *Client) Checkpoint(ctx context.Context, vmName, name string, opts *api.CheckpointOptions) (api.CheckpointInfo, error) {
	req := api.CheckpointRequest{VM: vmName, Name: name}
	if opts != nil {
		req.Pin, req.Handoff = opts.Pin, opts.Handoff
	}
	var o api.CheckpointObject
	err := c.call(ctx, http.MethodPost, "/v1/checkpoints", req, &o)
	return o.CheckpointInfo, err
}

// DeleteCheckpoint removes a checkpoint (api.Engine.DeleteCheckpoint).
func (c *Client) DeleteCheckpoint(ctx context.Context, name string, opts *api.DeleteCheckpointOptions) error {
	p := "/v1/checkpoints/" + url.PathEscape(name)
	if opts != nil && opts.Force {
		p += "?force=1"
	}
	return c.call(ctx, http.MethodDelete, p, nil, nil)
}

// Fork makes one fork of src (api.Engine.Fork); opts.Name names it.
func (c *Client) Fork(ctx context.Context, src string, opts *api.ForkOptions) (api.Info, error) {
	mo := &api.ManyOptions{}
	if opts != nil {
		mo.Overcommit, mo.Pin, mo.NoPark = opts.Overcommit, opts.Pin, opts.NoPark
		if opts.Name != "" {
			mo.Names = []string{opts.Name}
		}
		if len(opts.Publish) > 0 {
			mo.Publish = func(int) []api.PortForward { return opts.Publish }
		}
	}
	events, err := c.ForkMany(ctx, src, 1, mo)
	if err != nil {
		return api.Info{}, err
	}
	var ev ForkEvent
	got := false
	for e := range events {
		ev, got = e, true
	}
	switch {
	case !got:
		return api.Info{}, errors.New("client: fork stream ended without an event")
	case ev.Err != nil:
		return api.Info{}, ev.Err
	}
	return *ev.VM, nil
}

// ForkMany starts n forks of src and streams one event per fork as it becomes ready or
// fails; the channel is closed after the last one (api.Engine.ForkMany). Cancelling
// ctx before the stream ends disconnects, and the daemon then deletes every fork of the
// wave, reported ones too. opts.Publish is evaluated here for each index and sent as
// lists. If the stream breaks or ends before n events, a last event with Index -1
// carries the error, which says how many events arrived.
func (c *Client) ForkMany(ctx context.Context, src string, n int, opts *api.ManyOptions) (<-chan ForkEvent, error) {
	// The request is checked here as the daemon and its engine check it, so a bad one
	// costs no round trip, and named, so each fork's name is the one asked for.
	req, err := api.ForkRequestOf(src, n, opts)
	if err != nil {
		return nil, err
	}
	if err := req.Validate(); err != nil {
		return nil, err
	}
	req.Normalize()
	n = req.N
	resp, err := c.do(ctx, http.MethodPost, "/v1/forks", req)
	if err != nil {
		return nil, err
	}
	out := make(chan ForkEvent, n+1)
	go func() {
		defer close(out)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		got := 0
		for ; sc.Scan(); got++ {
			var o api.ForkEventObject
			if err := json.Unmarshal(sc.Bytes(), &o); err != nil {
				out <- ForkEvent{Index: -1, Err: fmt.Errorf("client: fork stream: %w", err)}
				return
			}
			out <- o.Event(eventError(resp.StatusCode, o))
		}
		err := sc.Err()
		if err == nil && got < n {
			err = io.ErrUnexpectedEOF
		}
		if err != nil {
			out <- ForkEvent{Index: -1, Err: fmt.Errorf("client: the fork stream ended after %d of %d forks (did the daemon stop? `forkvm ls` shows which forks exist): %w", got, n, err)}
		}
	}()
	return out, nil
}
