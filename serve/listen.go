package serve

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/forkvm/forkvm/api"
)

// SocketName is the daemon's socket in a state directory (api.SocketName).
const SocketName = api.SocketName

// maxSocketPath is the longest unix socket path (sun_path holds 108 bytes on Linux with
// its NUL, 104 on macOS).
const maxSocketPath = 103

// SocketPath is the daemon's socket for the state directory stateDir (api.SocketPath).
func SocketPath(stateDir string) string { return api.SocketPath(stateDir) }

var (
	// ErrDaemonRunning reports a socket on which another daemon answers.
	ErrDaemonRunning = errors.New("serve: another daemon answers on the socket")
	// ErrTokenFile reports a token file that is unsafe or unusable.
	ErrTokenFile = errors.New("serve: bad token file")
	// ErrNotLoopback reports a TCP address for the API that is not loopback, asked for
	// without public (ListenTCP).
	ErrNotLoopback = errors.New("serve: not a loopback address")
)

// ListenTCP listens on addr for the token-authenticated API (Server.TokenHandler). The
// API has no TLS, so its bearer token crosses the network in clear: an address that is
// not loopback (":7070", "0.0.0.0:P", a host name other than localhost) is refused with
// ErrNotLoopback unless public is set (serving behind a TLS proxy).
func ListenTCP(addr string, public bool) (net.Listener, error) {
	if err := CheckTCPAddr(addr, public); err != nil {
		return nil, err
	}
	return net.Listen("tcp", addr)
}

// CheckTCPAddr is ListenTCP's check of addr, for a caller that validates its options
// before it starts anything.
func CheckTCPAddr(addr string, public bool) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("serve: listen %s: %w", addr, err)
	}
	if ip := net.ParseIP(host); !(ip != nil && ip.IsLoopback()) && host != "localhost" && !public {
		return fmt.Errorf("%w: %s: the API has no TLS and its bearer token would cross the network in clear; "+
			"serve it there only behind a TLS proxy (forkvm serve --listen-public)", ErrNotLoopback, addr)
	}
	return nil
}

// ListenUnix listens on the unix socket path with mode 0600. If something answers on
// path it fails with ErrDaemonRunning; a stale socket (nobody answers) is removed;
// anything else at path (a file, a directory) is refused.
//
// No moment exists where the socket is reachable with a wider mode: it is bound inside
// a fresh 0700 directory next to path, chmodded to 0600 and checked there, and only then
// renamed onto path. Closing the listener removes path.
func ListenUnix(path string) (net.Listener, error) {
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&fs.ModeSocket == 0 {
			return nil, fmt.Errorf("serve: %s exists and is not a socket", path)
		}
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return nil, fmt.Errorf("%w: %s", ErrDaemonRunning, path)
		}
		if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
			return nil, fmt.Errorf("serve: remove stale socket: %w", err)
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, err
	}
	tmpDir, err := os.MkdirTemp(filepath.Dir(path), ".s")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmpDir)
	if err := os.Chmod(tmpDir, 0o700); err != nil {
		return nil, err
	}
	tmp := filepath.Join(tmpDir, "s")
	if len(tmp) > maxSocketPath {
		return nil, fmt.Errorf("serve: socket path %s is too long: a unix socket path has at most %d bytes, and it is bound first at %s (%d bytes); pick a shorter one with --socket",
			path, maxSocketPath, tmp, len(tmp))
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tmp, Net: "unix"})
	if err != nil {
		return nil, err
	}
	ln.SetUnlinkOnClose(false)
	fail := func(err error) (net.Listener, error) {
		ln.Close()
		return nil, err
	}
	if err := os.Chmod(tmp, 0o600); err != nil {
		return fail(err)
	}
	if fi, err := os.Lstat(tmp); err != nil {
		return fail(err)
	} else if fi.Mode().Perm() != 0o600 {
		return fail(fmt.Errorf("serve: socket mode is %v, not 0600", fi.Mode().Perm()))
	}
	if err := os.Rename(tmp, path); err != nil {
		return fail(err)
	}
	return &unixListener{Listener: ln, path: path}, nil
}

// unixListener removes its socket file when closed.
type unixListener struct {
	net.Listener
	path string
	once sync.Once
}

func (l *unixListener) Close() error {
	err := l.Listener.Close()
	l.once.Do(func() { os.Remove(l.path) })
	return err
}

// ReadTokenFile reads a bearer token from path: a regular file that only its owner can
// read or write (mode 0600 or 0400; anything readable by group or others is refused),
// holding one non-empty line of printable ASCII without spaces, at least 16 bytes.
//
// A path that is no regular file is refused before it is opened, and the file is opened
// with O_NONBLOCK and checked again: opening a FIFO for reading waits for a writer, and
// it would hang the daemon's start (or a FIFO put in the file's place in between).
func ReadTokenFile(path string) (string, error) {
	if fi, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("%w: %v", ErrTokenFile, err)
	} else if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("%w: %s is not a regular file", ErrTokenFile, path)
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrTokenFile, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrTokenFile, err)
	}
	if !fi.Mode().IsRegular() {
		return "", fmt.Errorf("%w: %s is not a regular file", ErrTokenFile, path)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return "", fmt.Errorf("%w: %s has mode %v; it must not be accessible to group or others (chmod 600)", ErrTokenFile, path, fi.Mode().Perm())
	}
	b, err := io.ReadAll(io.LimitReader(f, 4097))
	if err != nil {
		return "", fmt.Errorf("%w: %v", ErrTokenFile, err)
	}
	if len(b) > 4096 {
		return "", fmt.Errorf("%w: %s is over 4096 bytes", ErrTokenFile, path)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return "", fmt.Errorf("%w: %s: the token must be at least 16 bytes", ErrTokenFile, path)
	}
	for _, c := range tok {
		if c <= ' ' || c > '~' {
			return "", fmt.Errorf("%w: %s: the token must be one line of printable ASCII without spaces", ErrTokenFile, path)
		}
	}
	return tok, nil
}
