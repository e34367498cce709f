//go:build linux

package vsockd

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"net"
	"testing"
	"time"
)

// guestScript turns fuzz bytes into the frames a guest answers with: records of a type
// byte, a stream selector (even: the request's stream, odd: another one), a 16-bit
// length and that many payload bytes (short at the end: what is left).
func guestScript(data []byte, stream uint32) []Frame {
	var out []Frame
	for len(data) >= 4 {
		t, sel, n := FrameType(data[0]), data[1], int(binary.BigEndian.Uint16(data[2:]))
		data = data[4:]
		n = min(n, len(data))
		id := stream
		if sel%2 == 1 {
			id = stream + uint32(sel)
		}
		out = append(out, Frame{Type: t, Stream: id, Payload: data[:n]})
		data = data[n:]
	}
	return out
}

// scriptRecord encodes one guestScript record (for the seeds).
func scriptRecord(t FrameType, payload []byte) []byte {
	b := []byte{byte(t), 0}
	b = binary.BigEndian.AppendUint16(b, uint16(len(payload)))
	return append(b, payload...)
}

func jsonRecord(t FrameType, v any) []byte {
	p, _ := json.Marshal(v)
	return scriptRecord(t, p)
}

// FuzzClientReplies: whatever frames a guest answers a request with (on the request's
// stream or others), the host's Client never panics, and once the guest hangs up every
// operation returns promptly. The first byte picks the operation.
func FuzzClientReplies(f *testing.F) {
	var tok [16]byte
	f.Add(append([]byte{0}, jsonRecord(TypeHelloReply, helloReplyWire{Version: 2, Token: tok[:]})...))
	f.Add(append(append(append([]byte{1}, jsonRecord(TypeExecStarted, execStartedWire{Pid: 7})...),
		scriptRecord(TypeStdout, []byte("hello world"))...), jsonRecord(TypeExit, exitWire{Code: 3})...))
	f.Add(append(append([]byte{2}, scriptRecord(TypeFileData, []byte("abc"))...), scriptRecord(TypeFileEnd, nil)...))
	f.Add(append([]byte{3}, jsonRecord(TypeError, errorWire{Code: CodeNoSource, Message: "x"})...))
	f.Add(append([]byte{4}, jsonRecord(TypeStatReply, statReplyWire{Name: "f", Size: 3})...))
	f.Add(append(append([]byte{5}, scriptRecord(TypeWindow, []byte{0, 0, 0, 9})...), scriptRecord(TypeFileEnd, nil)...))
	f.Add(append([]byte{6}, scriptRecord(TypePong, nil)...))
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 {
			return
		}
		op, script := data[0]%7, data[1:]
		a, b := net.Pipe()
		go func() {
			first, err := readFrame(b)
			if err != nil {
				b.Close()
				return
			}
			go io.Copy(io.Discard, b) // keep taking what the client sends
			for _, fr := range guestScript(script, first.Stream) {
				if WriteFrame(b, fr) != nil {
					break
				}
			}
			b.Close()
		}()
		c := NewClient(a, nil)
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		done := make(chan struct{})
		go func() {
			defer close(done)
			switch op {
			case 0:
				c.Hello(ctx, Hello{})
			case 1:
				c.Run(ctx, &ExecRequest{Argv: []string{"x"}, MaxOutput: 5, Stdout: io.Discard, Stdin: bytes.NewReader([]byte("in"))})
			case 2:
				c.GetFile(ctx, "/f", io.Discard, 4)
			case 3:
				c.CopyOut(ctx, "/f", io.Discard)
			case 4:
				c.Stat(ctx, "/f")
			case 5:
				c.CopyIn(ctx, "/d", bytes.NewReader(make([]byte, 100)))
			case 6:
				c.Ping(ctx)
			}
		}()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("operation %d still running after the guest hung up", op)
		}
	})
}
