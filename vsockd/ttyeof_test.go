//go:build linux

package vsockd

import (
	"bytes"
	"strings"
	"testing"
)

// TestExecTTYStdinEOF: a TTY exec's command sees the end of its input when the host's
// stdin ends, as a pipe exec's does: cat exits, with a partial last line, a whole one, or
// no input at all. Before, the end of the host's stdin was dropped in TTY mode and each
// of these cats waited for more input until the test's deadline.
func TestExecTTYStdinEOF(t *testing.T) {
	c := pair(t, nil)
	for _, tc := range []struct{ name, in string }{
		{"partial line", "hello"},
		{"whole line", "hello\n"},
		{"no input", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out syncBuffer
			code, err := c.Run(tctx(t), &ExecRequest{Argv: []string{"cat"}, TTY: true,
				Stdin: strings.NewReader(tc.in), Stdout: &out})
			if err != nil || code != 0 {
				t.Fatalf("cat on a terminal whose input ended: code %d, %v (output %q)", code, err, out.String())
			}
			// The terminal echoes the input; cat writes it again.
			got := strings.ReplaceAll(out.String(), "\r", "")
			if want := strings.TrimSpace(tc.in); bytes.Count([]byte(got), []byte(want)) < 2 && want != "" {
				t.Fatalf("output %q, want %q echoed and copied", got, want)
			}
		})
	}
}
