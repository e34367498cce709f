package vsockd

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"strings"
	"testing"
)

func TestFrameRoundTrip(t *testing.T) {
	tests := []Frame{
		{Type: TypePing, Stream: 0},
		{Type: TypeHello, Stream: 1, Payload: []byte(`{"version":1}`)},
		{Type: TypeStdout, Stream: 0xdeadbeef, Payload: bytes.Repeat([]byte{0}, 1000)},
		{Type: TypeFileData, Stream: 7, Payload: bytes.Repeat([]byte("x"), MaxPayload)},
		{Type: FrameType(200), Stream: 9, Payload: []byte{1, 2, 3}},
	}
	for _, f := range tests {
		t.Run(f.Type.String(), func(t *testing.T) {
			var buf bytes.Buffer
			if err := WriteFrame(&buf, f); err != nil {
				t.Fatal(err)
			}
			if buf.Len() != HeaderSize+len(f.Payload) {
				t.Fatalf("encoded %d bytes", buf.Len())
			}
			if !bytes.HasPrefix(buf.Bytes(), []byte("FK\x02")) {
				t.Fatalf("bad header %q", buf.Bytes()[:4])
			}
			got, err := readFrame(bytes.NewReader(buf.Bytes()))
			if err != nil {
				t.Fatal(err)
			}
			if got.Type != f.Type || got.Stream != f.Stream || !bytes.Equal(got.Payload, f.Payload) {
				t.Fatalf("round trip mismatch: %v/%d/%d", got.Type, got.Stream, len(got.Payload))
			}
			got, err = NewDecoder(&buf).ReadFrame()
			if err != nil || got.Stream != f.Stream || !bytes.Equal(got.Payload, f.Payload) {
				t.Fatalf("decoder: %v", err)
			}
		})
	}
}

func TestWriteFrameTooLarge(t *testing.T) {
	err := WriteFrame(io.Discard, Frame{Type: TypeStdout, Payload: make([]byte, MaxPayload+1)})
	if !errors.Is(err, ErrFrameTooLarge) {
		t.Fatalf("got %v", err)
	}
}

func TestReadFrameErrors(t *testing.T) {
	valid, _ := AppendFrame(nil, Frame{Type: TypeStdout, Stream: 1, Payload: []byte("hello")})
	oversize := rawHeader(TypeStdout, 1, MaxPayload+1)
	badSum := append([]byte(nil), valid...)
	badSum[12] ^= 1
	tests := []struct {
		name string
		in   []byte
		want error
	}{
		{"empty", nil, io.EOF},
		{"oversize", oversize, ErrFrameTooLarge},
		{"bad magic", append([]byte("XK"), valid[2:]...), ErrBadFrame},
		{"bad version", append([]byte("FK\x01"), valid[3:]...), ErrBadFrame},
		{"bad checksum", badSum, ErrBadFrame},
		{"v1 header", []byte{'F', 'K', 1, byte(TypePong), 0, 0, 0, 1, 0, 0, 0, 0, 'F', 'K', 1, 3}, ErrBadFrame},
		{"truncated header", valid[:7], io.ErrUnexpectedEOF},
		{"truncated payload", valid[:len(valid)-1], io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := readFrame(bytes.NewReader(tt.in))
			if !errors.Is(err, tt.want) {
				t.Fatalf("ReadFrame: got %v, want %v", err, tt.want)
			}
			_, err = NewDecoder(bytes.NewReader(tt.in)).ReadFrame()
			if !errors.Is(err, tt.want) {
				t.Fatalf("Decoder: got %v, want %v", err, tt.want)
			}
			var fe *FrameError
			if (tt.want == ErrBadFrame || tt.want == ErrFrameTooLarge) && (!errors.As(err, &fe) || !strings.HasPrefix(err.Error(), "vsockd: ")) {
				t.Fatalf("want *FrameError with vsockd prefix, got %T %v", err, err)
			}
		})
	}
}

func TestDecoderResync(t *testing.T) {
	f1, _ := AppendFrame(nil, Frame{Type: TypePing, Stream: 1})
	f2, _ := AppendFrame(nil, Frame{Type: TypeStdin, Stream: 2, Payload: []byte("FK")})
	oversize := rawHeader(TypeStdin, 1, 0xffffffff)
	var in []byte
	in = append(in, "garbage FK\x02 F"...) // a false marker: rejected by the checksum
	in = append(in, f1...)
	in = append(in, oversize...)
	in = append(in, "FFFF"...)
	in = append(in, f2...)
	d := NewDecoder(bytes.NewReader(in))
	var got []uint32
	var bad int
	for {
		f, err := d.ReadFrame()
		if err == io.EOF {
			break
		}
		var fe *FrameError
		if errors.As(err, &fe) {
			bad++
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, f.Stream)
	}
	if len(got) != 2 || got[0] != 1 || got[1] != 2 || bad != 3 {
		t.Fatalf("frames %v, bad %d", got, bad)
	}
}

func FuzzReadFrame(f *testing.F) {
	valid, _ := AppendFrame(nil, Frame{Type: TypeHello, Stream: 1, Payload: []byte(`{"version":2}`)})
	f.Add(valid)
	f.Add(rawHeader(TypePing, 1, 0))
	f.Add(rawHeader(TypeStdout, 1, 0xffffffff))
	f.Add([]byte("FK\x01\x03\x00\x00\x00\x01\x00\x00\x00\x00")) // version 1
	f.Add([]byte("garbageFK\x02"))
	two, _ := AppendFrame(append(bytes.Repeat([]byte{0}, 9), valid...), Frame{Type: TypeStdout, Stream: 7, Payload: []byte("FK\x02")})
	f.Add(two) // a stale tail, then frames
	f.Fuzz(func(t *testing.T, data []byte) {
		fr, err := readFrame(bytes.NewReader(data))
		if err == nil {
			if len(fr.Payload) > MaxPayload {
				t.Fatalf("payload %d > MaxPayload", len(fr.Payload))
			}
			enc, err := AppendFrame(nil, fr)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(enc, data[:len(enc)]) {
				t.Fatalf("re-encoding differs")
			}
		}
		// The resynchronising decoder must always make progress.
		d := NewDecoder(bytes.NewReader(data))
		for i := 0; i <= len(data); i++ {
			fr, err := d.ReadFrame()
			var fe *FrameError
			if err != nil && !errors.As(err, &fe) {
				return
			}
			if len(fr.Payload) > MaxPayload {
				t.Fatal("oversize payload")
			}
		}
		t.Fatalf("decoder did not terminate on %d bytes", len(data))
	})
}

// rawHeader is a header with a valid checksum announcing n payload bytes
// (which need not follow).
func rawHeader(t FrameType, stream, n uint32) []byte {
	h := []byte{'F', 'K', ProtocolVersion, byte(t)}
	h = binary.BigEndian.AppendUint32(h, stream)
	h = binary.BigEndian.AppendUint32(h, n)
	return binary.BigEndian.AppendUint32(h, headerSum(h))
}

// readFrame reads exactly one frame from r (the tests' unbuffered reader: the
// agent and the client use a Decoder). It returns io.EOF at a clean
// frame boundary, io.ErrUnexpectedEOF for a truncated frame and a
// *FrameError for an invalid header. It never allocates more than
// MaxPayload bytes.
func readFrame(r io.Reader) (Frame, error) {
	var h [HeaderSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return Frame{}, err
	}
	t, id, n, err := parseHeader(h[:])
	if err != nil {
		return Frame{}, err
	}
	f := Frame{Type: t, Stream: id, Payload: make([]byte, n)}
	if _, err := io.ReadFull(r, f.Payload); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return f, nil
}
