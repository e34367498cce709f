package engine

import (
	"bytes"
	"context"
	"fmt"
	"strings"

	"github.com/forkvm/forkvm/vsockd"
)

// ExitError is returned by VM.Output when the command ran and exited with a non-zero
// code (or was killed: ExecRequest's conventions, 128+signal).
type ExitError struct {
	Argv   []string
	Code   int
	Stderr []byte // the command's standard error
}

// Error implements error.
func (e *ExitError) Error() string {
	msg := fmt.Sprintf("engine: %s exited %d", strings.Join(e.Argv, " "), e.Code)
	if s := strings.TrimSpace(string(e.Stderr)); s != "" {
		msg += ": " + s
	}
	return msg
}

// Output runs argv in the VM (as Exec does, with an empty stdin) and returns its
// standard output, so that a caller need not wire a bytes.Buffer as Stdout. A command
// that exits non-zero returns its output so far and an *ExitError carrying its code
// and standard error; a command that could not run returns Exec's error.
func (vm *VM) Output(ctx context.Context, argv ...string) ([]byte, error) {
	if len(argv) == 0 {
		return nil, fmt.Errorf("%w: Output needs a command", ErrInvalidSpec)
	}
	var stdout, stderr bytes.Buffer
	code, err := vm.Exec(ctx, &vsockd.ExecRequest{Argv: argv, Stdout: &stdout, Stderr: &stderr})
	if err != nil {
		return stdout.Bytes(), err
	}
	if code != 0 {
		return stdout.Bytes(), &ExitError{Argv: argv, Code: code, Stderr: stderr.Bytes()}
	}
	return stdout.Bytes(), nil
}
