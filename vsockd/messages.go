package vsockd

import (
	"fmt"
	"io/fs"
	"strings"

	"github.com/forkvm/forkvm/api"
)

// Wire payloads (JSON). They are separate from the public API types so the
// public types can use Go-friendly field types.

type helloWire struct {
	Version  int    `json:"version"`
	Token    []byte `json:"token"`   // 16 bytes
	Entropy  []byte `json:"entropy"` // random bytes for the guest CRNG
	TimeNs   int64  `json:"time_ns"` // host CLOCK_REALTIME, unix nanoseconds
	Hostname string `json:"hostname,omitempty"`
}

type helloReplyWire struct {
	Version  int    `json:"version"`
	Token    []byte `json:"token"`
	BootID   string `json:"boot_id"`
	UptimeNs int64  `json:"uptime_ns"`
	// Features lists what the agent supports beyond the version 2 base
	// (FeatureExecUser, FeatureCopy). An agent that predates a feature does
	// not list it, and the client refuses requests it would misread.
	Features []string `json:"features,omitempty"`
}

// Agent features announced in HelloReply (see helloReplyWire.Features).
const (
	// FeatureExecUser: ExecStart honours "user" (an older agent would
	// ignore the field and run the command as root).
	FeatureExecUser = "exec-user"
	// FeatureCopy: CopyIn, CopyOut and Stat requests.
	FeatureCopy = "copy"
)

// serverFeatures is what this package's Server announces.
var serverFeatures = []string{FeatureExecUser, FeatureCopy}

type execStartWire struct {
	Argv      []string `json:"argv"`
	Env       []string `json:"env,omitempty"`
	Dir       string   `json:"dir,omitempty"`
	TTY       bool     `json:"tty,omitempty"`
	Rows      uint16   `json:"rows,omitempty"`
	Cols      uint16   `json:"cols,omitempty"`
	Term      string   `json:"term,omitempty"`
	TimeoutNs int64    `json:"timeout_ns,omitempty"`
	User      string   `json:"user,omitempty"` // USER[:GROUP], names or ids (FeatureExecUser)
}

type execStartedWire struct {
	Pid int `json:"pid"`
}

type resizeWire struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

type signalWire struct {
	Signal int `json:"signal"`
}

type exitWire struct {
	Code     int  `json:"code"`             // exit status, or 128+signal
	Signal   int  `json:"signal,omitempty"` // terminating signal, if any
	TimedOut bool `json:"timed_out,omitempty"`
}

type filePutWire struct {
	Path string `json:"path"`
	Mode uint32 `json:"mode"` // permission bits
}

type fileGetWire struct {
	Path string `json:"path"`
	Max  int64  `json:"max"` // <= 0: unlimited
}

// copyInWire starts a CopyIn: a tar stream (FileData frames, then FileEnd)
// is extracted into the existing guest directory Dir.
type copyInWire struct {
	Dir string `json:"dir"`
}

// copyOutWire starts a CopyOut: the guest streams a tar of Path (a file,
// a directory recursively, or a symlink as a symlink) in FileData frames,
// then FileEnd.
type copyOutWire struct {
	Path string `json:"path"`
}

// statWire asks for the attributes of Path (symlinks followed).
type statWire struct {
	Path string `json:"path"`
}

// statReplyWire answers a Stat.
type statReplyWire struct {
	Name    string `json:"name"`
	Size    int64  `json:"size"`
	Mode    uint32 `json:"mode"` // Go fs.FileMode bits
	MtimeNs int64  `json:"mtime_ns"`
}

// Error codes carried in Error frames.
const (
	CodeBadFrame   = "bad_frame" // undecodable frame (stream 0)
	CodeBadRequest = "bad_request"
	CodeNotExist   = "not_exist"
	CodeTooLarge   = "too_large"
	CodeExec       = "exec_failed"
	CodeIO         = "io"
	CodeOverrun    = "overrun"
	CodeUnknown    = "unknown_stream"
	// Exec failures before the command ran (version 2). The message names
	// the command, or the directory for CodeWorkdir.
	CodeNotFound      = "not_found"      // command not found (ENOENT)
	CodeNotExecutable = "not_executable" // command found but not executable (EACCES, ENOEXEC, ...)
	CodeWorkdir       = "bad_workdir"    // working directory missing or unusable
	CodeUser          = "unknown_user"   // ExecStart's user or group is not in /etc/passwd, /etc/group
	// Copy failures (FeatureCopy).
	CodeNoSource = "no_source"    // the path to copy does not exist
	CodeNotDir   = "not_dir"      // the destination is missing or not a directory
	CodeUnsafe   = "unsafe_entry" // an archive entry would leave the destination
	// CodeBadArchive: the tar stream is malformed (a bad header, more than 1 MiB after
	// its end, empty where an entry was expected).
	CodeBadArchive = "bad_archive"
)

type errorWire struct {
	Code    string `json:"code"`
	Message string `json:"message"`
}

// Errors returned by the client.
var (
	// ErrTokenMismatch is returned (wrapped) by Client.Hello when the guest
	// echoes a different token.
	ErrTokenMismatch = api.ErrTokenMismatch
	// ErrClosed is returned after the client is closed or its connection failed.
	ErrClosed = api.ErrAgentClosed
	// ErrOutputLimit is returned when an exec produced more than
	// ClientConfig.MaxOutput bytes of output; the process is killed.
	ErrOutputLimit = api.ErrOutputLimit
	// ErrFileTooLarge is returned by GetFile when the file exceeds max.
	ErrFileTooLarge = api.ErrFileTooLarge
	// ErrStreamReset is returned when the peer aborted the stream.
	ErrStreamReset = api.ErrStreamReset
	// ErrSessionReset is returned for operations interrupted by a new Hello.
	ErrSessionReset = api.ErrSessionReset
	// ErrProtocol reports a peer violating the protocol.
	ErrProtocol = api.ErrProtocol
	// ErrUnsupported is returned by operations not available on this platform.
	ErrUnsupported = api.ErrUnsupported
	// ErrConnLost is returned (wrapped, with the cause) by every pending and
	// later operation once the connection to the agent broke (EOF, I/O
	// error, undecodable stream). The client is then Done; dial a new one.
	ErrConnLost = api.ErrConnLost
	// ErrEmptyArgv is returned by Start/Run for a request without argv.
	ErrEmptyArgv = api.ErrEmptyArgv
	// ErrInvalidRequest is returned (wrapped) by Start/Run for a request the guest
	// cannot run as given (a NUL byte in argv, env, dir or user).
	ErrInvalidRequest = api.ErrInvalidRequest
	// ErrNotFound is returned (wrapped) by Start/Run when the command does
	// not exist in the guest; Run returns ExitCodeNotFound with it.
	ErrNotFound = api.ErrCommandNotFound
	// ErrNotExecutable is returned (wrapped) by Start/Run when the command
	// exists but cannot be executed; Run returns ExitCodeNotExecutable.
	ErrNotExecutable = api.ErrNotExecutable
	// ErrWorkdir is returned (wrapped, naming the directory) by Start/Run
	// when ExecRequest.Dir does not exist or is not a usable directory.
	ErrWorkdir = api.ErrWorkdir
	// ErrUnknownUser is returned (wrapped, naming the user or group) by
	// Start/Run when ExecRequest.User is not in the guest's /etc/passwd (or
	// its group not in /etc/group).
	ErrUnknownUser = api.ErrUnknownUser
)

// Errors of copies (Client.CopyIn, Client.CopyOut, tarstream.WriteTar, tarstream.ExtractTar),
// on either end: a guest's Error frame maps onto them too.
var (
	// ErrSourceMissing reports a path to copy that does not exist. It also
	// matches fs.ErrNotExist.
	ErrSourceMissing = api.ErrSourceMissing
	// ErrNotDirectory reports a copy destination that is missing or not a
	// directory (or a directory to be written over a non-directory).
	ErrNotDirectory = api.ErrNotDirectory
	// ErrUnsafeEntry reports an archive entry that would leave the
	// destination directory (an absolute name, a ".." component, a path
	// through a symlink the archive itself made, a device node); the
	// message names it.
	ErrUnsafeEntry = api.ErrUnsafeEntry
	// ErrBadArchive reports a malformed tar stream (a bad header, more than 1 MiB of
	// data after the end of the archive, such as an all-zero body).
	ErrBadArchive = api.ErrBadArchive
)

// Shell-style exit codes for commands that could not run (see Run).
const (
	ExitCodeNotExecutable = api.ExitCodeNotExecutable
	ExitCodeNotFound      = api.ExitCodeNotFound
	// ExitCodeSignalBase + N is the exit code of a command killed by signal N.
	ExitCodeSignalBase = api.ExitCodeSignalBase
)

// RemoteError is an error reported by the guest in an Error frame. It
// matches fs.ErrNotExist and ErrFileTooLarge with errors.Is where the code
// says so.
type RemoteError struct {
	Code    string
	Message string
}

// Error implements error.
// Error is the guest's message under one "guest:" prefix (the guest's own "vsockd:"
// dropped: the host's caller adds its own), with the code only when there is no message.
func (e *RemoteError) Error() string {
	if e.Message == "" {
		return fmt.Sprintf("guest: error %s", e.Code)
	}
	return "guest: " + strings.TrimPrefix(e.Message, "vsockd: ")
}

// Is maps well-known codes onto sentinel errors.
func (e *RemoteError) Is(target error) bool {
	switch e.Code {
	case CodeNotExist:
		return target == fs.ErrNotExist
	case CodeTooLarge:
		return target == ErrFileTooLarge
	case CodeOverrun:
		return target == ErrProtocol
	case CodeNotFound:
		return target == ErrNotFound
	case CodeNotExecutable:
		return target == ErrNotExecutable
	case CodeWorkdir:
		return target == ErrWorkdir
	case CodeUser:
		return target == ErrUnknownUser
	case CodeNoSource:
		return target == ErrSourceMissing || target == fs.ErrNotExist
	case CodeNotDir:
		return target == ErrNotDirectory
	case CodeUnsafe:
		return target == ErrUnsafeEntry
	case CodeBadArchive:
		return target == ErrBadArchive
	}
	return false
}
