//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"io"
	"strconv"
	"strings"
	"testing"
)

// trickleReader returns head in one Read, then the bytes of tail one per Read: what a
// host's stdin gives when a producer writes small lines slowly (tail -f | forkvm exec).
type trickleReader struct {
	head []byte
	tail []byte
}

func (r *trickleReader) Read(p []byte) (int, error) {
	if len(r.head) > 0 {
		n := copy(p, r.head)
		r.head = r.head[n:]
		return n, nil
	}
	if len(r.tail) == 0 {
		return 0, io.EOF
	}
	p[0] = r.tail[0]
	r.tail = r.tail[1:]
	return 1, nil
}

// TestExecStdinSmallFramesToBusyCommand: an honest host keeps within its byte window, but
// may spend it in frames of one byte each. A command that reads none of its stdin for a
// while (its pipe full) must not have its stream reset for the number of frames queued
// meanwhile, and must get every byte, in order.
func TestExecStdinSmallFramesToBusyCommand(t *testing.T) {
	c := pair(t, nil)
	head := bytes.Repeat([]byte("h"), 70000) // more than a pipe holds
	tail := []byte(strings.Repeat("0123456789", 2*maxQueuedFrames/10))
	var out bytes.Buffer
	code, err := c.Run(tctx(t), &ExecRequest{
		Argv:   []string{"sh", "-c", "sleep 1; cat"},
		Stdin:  &trickleReader{head: head, tail: tail},
		Stdout: &out,
	})
	if err != nil || code != 0 {
		t.Fatalf("code %d err %v", code, err)
	}
	if want := append(head, tail...); !bytes.Equal(out.Bytes(), want) {
		t.Fatalf("the command read %d bytes, want %d", out.Len(), len(want))
	}
}

// TestInboxSmallFrames: frames of one byte each, up to the byte window and interleaved
// between two data types, all queue (however many frames that is), and pop gives every
// type's bytes in order; empty data frames queue nothing.
func TestInboxSmallFrames(t *testing.T) {
	for _, tc := range []struct {
		name   string
		frames int
		types  []FrameType
	}{
		{"one type", 4 * maxQueuedFrames, []FrameType{TypeStdout}},
		{"interleaved", 4 * maxQueuedFrames, []FrameType{TypeStdout, TypeStderr}},
		{"a whole window", InitialWindow, []FrameType{TypeStdin}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newInbox()
			want := map[FrameType][]byte{}
			for i := range tc.frames {
				ft := tc.types[i%len(tc.types)]
				p := []byte{strconv.Itoa(i % 10)[0]}
				if err := b.push(Frame{Type: ft, Stream: 1, Payload: p}); err != nil {
					t.Fatalf("frame %d: %v", i, err)
				}
				want[ft] = append(want[ft], p...)
				if err := b.push(Frame{Type: ft, Stream: 1}); err != nil {
					t.Fatalf("empty frame after %d: %v", i, err)
				}
			}
			if err := b.push(Frame{Type: TypeExit, Stream: 1, Payload: []byte("{}")}); err != nil {
				t.Fatalf("exit: %v", err)
			}
			b.fail(io.EOF, false)
			got := map[FrameType][]byte{}
			last := false
			for {
				f, err := b.pop(context.Background())
				if err != nil {
					break
				}
				if last {
					t.Fatalf("%v after Exit", f.Type)
				}
				if f.Type == TypeExit {
					last = true
					continue
				}
				got[f.Type] = append(got[f.Type], f.Payload...)
				b.release(len(f.Payload))
			}
			for _, ft := range tc.types {
				if !bytes.Equal(got[ft], want[ft]) {
					t.Errorf("%v: got %d bytes, want %d (or not in order)", ft, len(got[ft]), len(want[ft]))
				}
			}
			if !last {
				t.Error("Exit lost")
			}
		})
	}
}

// TestInboxFloodStillBounded: merging keeps the bounds: bytes past the window, or
// control frames past maxQueuedFrames, are an overrun still.
func TestInboxFloodStillBounded(t *testing.T) {
	b := newInbox()
	var err error
	for i := 0; i <= InitialWindow && err == nil; i++ {
		err = b.push(Frame{Type: TypeStdout, Stream: 1, Payload: []byte{'x'}})
	}
	if err != errOverrun {
		t.Fatalf("past the window: %v", err)
	}
	b = newInbox()
	err = nil
	for i := 0; i <= maxQueuedFrames && err == nil; i++ {
		err = b.push(Frame{Type: TypeStdinClose, Stream: 1})
	}
	if err != errOverrun {
		t.Fatalf("control frames past the limit: %v", err)
	}
}
