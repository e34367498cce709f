package api

import (
	"io/fs"
	"path/filepath"
	"time"
)

// Schema names of the JSON objects (the CLI's --json prints the same shapes).
const (
	VMSchema         = "forkvm.vm/v1"
	CheckpointSchema = "forkvm.checkpoint/v1"
	ForkEventSchema  = "forkvm.fork-event/v1"
	DaemonSchema     = "forkvm.daemon/v1"
)

// SocketName is the daemon's unix socket in its state directory.
const SocketName = "forkvm.sock"

// SocketPath is where the daemon of the state directory stateDir listens: the one path a
// daemon (package serve) and the programs that look for it (serve/local.Open) share.
func SocketPath(stateDir string) string { return filepath.Join(stateDir, SocketName) }

// ExecUpgrade is the Upgrade protocol of an attached exec: POST /v1/vms/{name}/exec
// with "Connection: Upgrade" and "Upgrade: forkvm-exec/1" is answered 101, after which
// the connection carries ExecInput lines to the daemon and ExecLine lines back.
const ExecUpgrade = "forkvm-exec/1"

// DaemonObject describes the daemon (GET /v1/info).
type DaemonObject struct {
	Schema   string `json:"schema"`
	PID      int    `json:"pid"`
	StateDir string `json:"state_dir"`
	Accel    string `json:"accel"`
	// Counters says whether the daemon's engine counts each QEMU's kernel work
	// (engine Config.Counters, `forkvm serve --counters`): then every VM it starts has
	// Info.Counters and its spans theirs.
	Counters bool `json:"counters"`
	// Faults says whether the daemon counts each fork's page faults by class until
	// ready (`forkvm serve --faults`, root: eBPF): then every fork event it streams
	// has them (ForkEventObject.Faults) and so do its VM objects (Info.Faults).
	Faults bool `json:"faults"`
}

// VMObject is a VM (forkvm.vm/v1): its Info with a schema name.
type VMObject struct {
	Schema string `json:"schema"`
	Info
}

// NewVMObject wraps an Info.
func NewVMObject(inf Info) VMObject { return VMObject{Schema: VMSchema, Info: inf} }

// CheckpointObject is a checkpoint with its live forks (forkvm.checkpoint/v1).
type CheckpointObject struct {
	Schema string `json:"schema"`
	CheckpointInfo
}

// NewCheckpointObject wraps an CheckpointInfo (Forks is [] when empty).
func NewCheckpointObject(c CheckpointInfo) CheckpointObject {
	if c.Forks == nil {
		c.Forks = []string{}
	}
	return CheckpointObject{Schema: CheckpointSchema, CheckpointInfo: c}
}

// ForkEventObject is one line of a fork stream (forkvm.fork-event/v1): a fork that
// became ready (VM set) or failed (Error and Code set).
type ForkEventObject struct {
	Schema    string  `json:"schema"`
	Index     int     `json:"index"`
	Name      string  `json:"name"`
	OK        bool    `json:"ok"`
	LatencyMS float64 `json:"latency_ms"`
	Error     string  `json:"error,omitempty"`
	Code      string  `json:"code,omitempty"`
	// Resource, Requested, Available and Budget are an admission refusal's figures
	// (code "admission"), as in ErrorObject.
	Resource  string    `json:"resource,omitempty"`
	Requested int64     `json:"requested,omitempty"`
	Available int64     `json:"available,omitempty"`
	Budget    int64     `json:"budget,omitempty"`
	VM        *VMObject `json:"vm,omitempty"`
	// Faults is a ready fork's page faults by class until ready, when they were
	// counted (forkvm serve --faults, forkvm fork --faults).
	Faults *FaultClasses `json:"faults,omitempty"`
}

// ForkEventObjectOf builds a fork event: a ready fork (inf set, err nil) or a failed one.
func ForkEventObjectOf(index int, name string, latency time.Duration, inf *Info, err error) ForkEventObject {
	out := ForkEventObject{Schema: ForkEventSchema, Index: index, Name: name, OK: err == nil,
		LatencyMS: float64(latency) / float64(time.Millisecond)}
	if err != nil {
		o, _ := ErrorObjectOf(err)
		out.Error, out.Code = err.Error(), o.Code
		out.Resource, out.Requested, out.Available, out.Budget = o.Resource, o.Requested, o.Available, o.Budget
	} else if inf != nil {
		v := NewVMObject(*inf)
		out.VM = &v
	}
	return out
}

// ExecBody is the body of POST /v1/vms/{name}/exec: an ExecRequest without its
// streams.
type ExecBody struct {
	Argv    []string `json:"argv"`
	Env     []string `json:"env,omitempty"`
	Workdir string   `json:"workdir,omitempty"`
	User    string   `json:"user,omitempty"`
	// Stdin is the process's standard input as text; StdinBase64 as bytes (JSON
	// base64). At most one of them.
	Stdin       string `json:"stdin,omitempty"`
	StdinBase64 []byte `json:"stdin_base64,omitempty"`
	// MaxOutput bounds stdout+stderr bytes (0: the agent client's default, 64 MiB;
	// negative: no bound).
	MaxOutput int64 `json:"max_output,omitempty"`
	// TimeoutMS, when > 0, is enforced by the guest (exit code 124).
	TimeoutMS int64 `json:"timeout_ms,omitempty"`
	// TTY runs the command on a pseudo terminal of Rows x Cols (TERM from Term, default
	// xterm); all output arrives as stdout.
	TTY  bool   `json:"tty,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	Term string `json:"term,omitempty"`
}

// ExecInput is one line a client sends on an attached exec's connection: exactly one
// field is set. Stdin is base64 in JSON; StdinEOF closes the command's stdin; Signal
// sends a signal to its process group (SIGKILL: to all it started); Resize changes its
// terminal's size.
type ExecInput struct {
	Stdin    []byte      `json:"stdin,omitempty"`
	StdinEOF bool        `json:"stdin_eof,omitempty"`
	Signal   int         `json:"signal,omitempty"`
	Resize   *ResizeSize `json:"resize,omitempty"`
}

// ResizeSize is a terminal size.
type ResizeSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// FileStat is a guest path's attributes (GET /v1/vms/{name}/stat).
type FileStat struct {
	Name    string    `json:"name"`
	Size    int64     `json:"size_bytes"`
	Mode    uint32    `json:"mode"` // Go fs.FileMode bits
	ModTime time.Time `json:"mod_time"`
	IsDir   bool      `json:"is_dir"`
}

// NewFileStat converts an fs.FileInfo.
func NewFileStat(fi fs.FileInfo) FileStat {
	return FileStat{Name: fi.Name(), Size: fi.Size(), Mode: uint32(fi.Mode()), ModTime: fi.ModTime().UTC(), IsDir: fi.IsDir()}
}

// fileInfo is a FileStat as an fs.FileInfo.
type fileInfo struct{ s FileStat }

func (f fileInfo) Name() string       { return f.s.Name }
func (f fileInfo) Size() int64        { return f.s.Size }
func (f fileInfo) Mode() fs.FileMode  { return fs.FileMode(f.s.Mode) }
func (f fileInfo) ModTime() time.Time { return f.s.ModTime }
func (f fileInfo) IsDir() bool        { return f.s.IsDir }
func (f fileInfo) Sys() any           { return nil }

// FileInfo returns s as an fs.FileInfo.
func (s FileStat) FileInfo() fs.FileInfo { return fileInfo{s} }

// CheckpointPatch is the body of PATCH /v1/checkpoints/{name}.
type CheckpointPatch struct {
	Pinned *bool `json:"pinned"`
}

// PoolRequest is the body of PUT /v1/checkpoints/{name}/pool: keep N pooled processes
// (0 empties the pool); Restored and WarmUp as in WarmOptions.
type PoolRequest struct {
	N        int      `json:"n"`
	Restored bool     `json:"restored,omitempty"`
	WarmUp   []string `json:"warm_up,omitempty"`
}

// PoolObject is a checkpoint's warm pool.
type PoolObject struct {
	Checkpoint string `json:"checkpoint"`
	Size       int    `json:"size"`
}

// ReapResponse is the answer of POST /v1/reap: the dead VMs removed.
type ReapResponse struct {
	Removed []string `json:"removed"`
}

// ExecLine is one NDJSON line of an exec response: exactly one field is set. Stdout and
// Stderr are base64 in JSON; ExitCode ends a successful stream, Error a failed one.
type ExecLine struct {
	Stdout   []byte       `json:"stdout,omitempty"`
	Stderr   []byte       `json:"stderr,omitempty"`
	ExitCode *int         `json:"exit_code,omitempty"`
	Error    *ErrorObject `json:"error,omitempty"`
}

// CheckpointRequest is the body of POST /v1/checkpoints.
type CheckpointRequest struct {
	VM      string `json:"vm"`
	Name    string `json:"name,omitempty"`
	Pin     bool   `json:"pin,omitempty"`
	Handoff bool   `json:"handoff,omitempty"`
}

// ForkRequest is one request for forks: the body of POST /v1/forks, and what the CLI,
// the daemon's client (ForkRequestOf), the daemon and the engine's planner each
// Normalize and Validate, so that every rule of a fork request and its error text exist
// once (api/fork.go).
type ForkRequest struct {
	Source string `json:"source"`
	// Name names a single fork (n must be 0 or 1); Names names each of the n forks.
	Name  string   `json:"name,omitempty"`
	Names []string `json:"names,omitempty"`
	// N is the number of forks (0 means len(Names), else 1).
	N           int     `json:"n,omitempty"`
	Prefix      string  `json:"prefix,omitempty"`
	Concurrency int     `json:"concurrency,omitempty"`
	Overcommit  float64 `json:"overcommit,omitempty"`
	Pin         bool    `json:"pin,omitempty"`
	// Publish[i] are fork i's port forwards (the source VM must have a NIC); a shorter
	// list leaves the rest without.
	Publish [][]PortForward `json:"publish,omitempty"`
	// NoPark opts every fork of the request out of a daemon's idle parking
	// (Spec.NoPark), from the moment it is ready.
	NoPark bool `json:"no_park,omitempty"`
}
