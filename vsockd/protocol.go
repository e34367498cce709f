// Package vsockd implements the forkvm guest-agent protocol: a small framed,
// multiplexed protocol spoken between the host engine (Client) and the agent
// running as /init inside the guest (Server), over virtio-serial, AF_VSOCK or
// (for tests) unix sockets.
//
// # Wire format
//
// Every message is a frame:
//
//	offset size field
//	0      2    magic "FK"
//	2      1    version (ProtocolVersion, 2)
//	3      1    type (FrameType)
//	4      4    stream id, uint32 big endian
//	8      4    payload length, uint32 big endian (<= MaxPayload)
//	12     4    CRC-32C (Castagnoli) of bytes 0..11, big endian
//	16     n    payload
//
// Version 2 added the header checksum (version 1 had a 12 byte header
// without it). The stream id multiplexes any number of requests over one
// connection; the checksum lets a reader that lost frame alignment (the tail
// of a frame left on a virtio-serial port by an earlier host connection)
// find the next real frame boundary instead of decoding payload bytes as a
// header: a false "FK" in data passes the check with probability 2^-32.
//
// Senders keep every frame at most maxWireFrame (32 KiB) long. The guest's
// virtio-serial driver moves at most 32 KiB per write(2), so a longer frame
// would be split, and a host that disconnects between the pieces would leave
// half a frame for the next connection; a frame that fits one write is
// delivered whole or not at all.
//
// Control payloads (Hello, ExecStart, Exit, Error, ...) are JSON objects; data
// payloads (Stdin, Stdout, Stderr, FileData) are raw bytes and Window is a
// uint32 big endian credit increment. All requests are initiated by the host,
// each on a fresh stream id; replies and data for that request carry the same
// id, so any number of execs and file transfers can run concurrently over a
// single connection. Stream 0 is used by the guest for connection-level
// errors (for example an undecodable frame).
//
// # Flow control
//
// Data frames are credit based, like HTTP/2 windows. For each stream and each
// direction the sender starts with InitialWindow bytes of credit and may only
// send data payload bytes while it has credit; the receiver returns credit
// with a Window frame after the data has been consumed (written to the
// process, the file, or the caller's io.Writer). Receivers never block their
// connection reader: incoming frames are appended to a per-stream queue that
// by construction never holds more than InitialWindow data bytes, and a peer
// that overruns its window (or queues too many control frames) gets that
// stream reset. A slow consumer thus only stalls its own stream, and a
// malicious peer can only make the receiver buffer InitialWindow bytes per
// stream.
//
// # Features and copies
//
// Requests added after version 2 was fixed do not change the frame format or
// the Hello exchange: the agent lists what it supports in
// HelloReply.Features, and the client refuses (ErrUnsupported) a request an
// older agent would misread instead of sending it. FeatureExecUser covers
// ExecStart's "user" field; FeatureCopy the CopyIn, CopyOut and Stat
// requests. A copy moves a tar stream (archive/tar, written and extracted in
// Go on both ends: see tarstream.WriteTar and tarstream.ExtractTar) in flow-controlled FileData
// frames ended by FileEnd, on the request's own stream: CopyIn sends it to the
// guest, which answers FileEnd once it is extracted; CopyOut receives it.
// Either side may end the stream early with an Error frame (codes no_source,
// not_dir, unsafe_entry, io) or a Reset.
package vsockd

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"io"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/internal/guestboot"
)

const (
	// ProtocolVersion is the frame format version carried in every header
	// and in Hello/HelloReply. Version 2: header checksum, exec error codes
	// (not_found, not_executable, bad_workdir).
	ProtocolVersion = 2
	// DefaultVsockPort is the AF_VSOCK port the agent listens on.
	DefaultVsockPort = 1024
	// PortName is the virtio-serial port name the agent serves.
	PortName = guestboot.AgentPortName
	// MaxPayload is the largest payload a frame may carry.
	MaxPayload = 1 << 20
	// HeaderSize is the size of the fixed frame header.
	HeaderSize = 16
	// InitialWindow is the per-stream, per-direction flow-control credit in
	// bytes that each side starts with.
	InitialWindow = 256 << 10
	// maxWireFrame is the largest frame either side sends (see the package
	// comment: one virtio-serial write).
	maxWireFrame = 32 << 10
	// chunkSize is the data payload size used by both sides when streaming.
	chunkSize = maxWireFrame - HeaderSize
)

var crcTable = crc32.MakeTable(crc32.Castagnoli)

// headerSum is the checksum stored at bytes 12..15 of a header.
func headerSum(h []byte) uint32 { return crc32.Checksum(h[:12], crcTable) }

// Magic is the two byte frame marker.
const Magic = "FK"

// FrameType identifies the meaning of a frame.
type FrameType uint8

// Frame types. Host->guest requests: Hello, Ping, ExecStart, Stdin,
// StdinClose, Resize, Signal, FilePut, FileData, FileEnd, FileGet, CopyIn,
// CopyOut, Stat, Reset, Window. Guest->host: HelloReply, Pong, ExecStarted,
// Stdout, Stderr, Exit, FileData, FileEnd, StatReply, Error, Reset, Window.
const (
	TypeHello       FrameType = 1  // JSON helloWire; resets the guest session
	TypeHelloReply  FrameType = 2  // JSON helloReplyWire
	TypePing        FrameType = 3  // empty
	TypePong        FrameType = 4  // empty
	TypeExecStart   FrameType = 5  // JSON execStartWire
	TypeStdin       FrameType = 6  // raw bytes
	TypeStdinClose  FrameType = 7  // empty
	TypeStdout      FrameType = 8  // raw bytes
	TypeStderr      FrameType = 9  // raw bytes
	TypeResize      FrameType = 10 // JSON resizeWire
	TypeSignal      FrameType = 11 // JSON signalWire
	TypeExit        FrameType = 12 // JSON exitWire
	TypeFilePut     FrameType = 13 // JSON filePutWire
	TypeFileData    FrameType = 14 // raw bytes
	TypeFileEnd     FrameType = 15 // empty (end of data / put committed)
	TypeFileGet     FrameType = 16 // JSON fileGetWire
	TypeError       FrameType = 17 // JSON errorWire; terminates the stream
	TypeReset       FrameType = 18 // empty; abort the stream (kills its process)
	TypeExecStarted FrameType = 19 // JSON execStartedWire
	TypeWindow      FrameType = 20 // uint32 BE credit increment
	// Copies (FeatureCopy; added within version 2: an agent without them
	// answers with a bad_request Error, and does not announce FeatureCopy).
	TypeCopyIn    FrameType = 21 // JSON copyInWire; then FileData (a tar stream) and FileEnd
	TypeCopyOut   FrameType = 22 // JSON copyOutWire; answered with FileData (a tar stream) and FileEnd
	TypeStat      FrameType = 23 // JSON statWire
	TypeStatReply FrameType = 24 // JSON statReplyWire
)

var typeNames = map[FrameType]string{
	TypeHello: "Hello", TypeHelloReply: "HelloReply", TypePing: "Ping", TypePong: "Pong",
	TypeExecStart: "ExecStart", TypeStdin: "Stdin", TypeStdinClose: "StdinClose",
	TypeStdout: "Stdout", TypeStderr: "Stderr", TypeResize: "Resize", TypeSignal: "Signal",
	TypeExit: "Exit", TypeFilePut: "FilePut", TypeFileData: "FileData", TypeFileEnd: "FileEnd",
	TypeFileGet: "FileGet", TypeError: "Error", TypeReset: "Reset",
	TypeExecStarted: "ExecStarted", TypeWindow: "Window",
	TypeCopyIn: "CopyIn", TypeCopyOut: "CopyOut", TypeStat: "Stat", TypeStatReply: "StatReply",
}

// String returns the name of the frame type.
func (t FrameType) String() string {
	if s, ok := typeNames[t]; ok {
		return s
	}
	return fmt.Sprintf("FrameType(%d)", uint8(t))
}

// isData reports whether frames of type t carry flow-controlled data.
func (t FrameType) isData() bool {
	switch t {
	case TypeStdin, TypeStdout, TypeStderr, TypeFileData:
		return true
	}
	return false
}

// Frame is one decoded protocol message.
type Frame struct {
	Type    FrameType
	Stream  uint32
	Payload []byte
}

// Sentinel errors of the frame codec.
var (
	// ErrBadFrame reports a header with a wrong magic or version.
	ErrBadFrame = api.ErrBadFrame
	// ErrFrameTooLarge reports a payload longer than MaxPayload.
	ErrFrameTooLarge = api.ErrFrameTooLarge
)

// FrameError describes a decoding or encoding failure. It unwraps to
// ErrBadFrame or ErrFrameTooLarge.
type FrameError struct {
	Err    error  // ErrBadFrame or ErrFrameTooLarge
	Reason string // human readable detail
	// Version is the version byte of a header rejected only for its version
	// (a peer speaking another protocol version), else 0.
	Version int
}

// Error implements error.
func (e *FrameError) Error() string { return e.Err.Error() + ": " + e.Reason }

// Unwrap returns the sentinel error.
func (e *FrameError) Unwrap() error { return e.Err }

// AppendFrame appends the encoding of f to dst.
func AppendFrame(dst []byte, f Frame) ([]byte, error) {
	if len(f.Payload) > MaxPayload {
		return dst, &FrameError{Err: ErrFrameTooLarge, Reason: fmt.Sprintf("payload of %d bytes exceeds %d", len(f.Payload), MaxPayload)}
	}
	start := len(dst)
	dst = append(dst, Magic[0], Magic[1], ProtocolVersion, byte(f.Type))
	dst = binary.BigEndian.AppendUint32(dst, f.Stream)
	dst = binary.BigEndian.AppendUint32(dst, uint32(len(f.Payload)))
	dst = binary.BigEndian.AppendUint32(dst, headerSum(dst[start:]))
	return append(dst, f.Payload...), nil
}

// WriteFrame writes f to w with a single Write call.
func WriteFrame(w io.Writer, f Frame) error {
	b, err := AppendFrame(make([]byte, 0, HeaderSize+len(f.Payload)), f)
	if err != nil {
		return err
	}
	_, err = w.Write(b)
	return err
}

// parseHeader validates a HeaderSize byte header and returns type, stream
// and length.
func parseHeader(h []byte) (FrameType, uint32, uint32, error) {
	if h[0] != Magic[0] || h[1] != Magic[1] {
		return 0, 0, 0, &FrameError{Err: ErrBadFrame, Reason: fmt.Sprintf("bad magic %#x", h[:2])}
	}
	if h[2] != ProtocolVersion {
		return 0, 0, 0, &FrameError{ErrBadFrame, fmt.Sprintf("unsupported version %d (want %d)", h[2], ProtocolVersion), int(h[2])}
	}
	if sum := binary.BigEndian.Uint32(h[12:16]); sum != headerSum(h) {
		return 0, 0, 0, &FrameError{Err: ErrBadFrame, Reason: fmt.Sprintf("header checksum %#x, want %#x", sum, headerSum(h))}
	}
	n := binary.BigEndian.Uint32(h[8:12])
	if n > MaxPayload {
		return 0, 0, 0, &FrameError{Err: ErrFrameTooLarge, Reason: fmt.Sprintf("payload length %d exceeds %d", n, MaxPayload)}
	}
	return FrameType(h[3]), binary.BigEndian.Uint32(h[4:8]), n, nil
}

// Decoder reads frames from a byte stream and can resynchronise after a
// corrupt header: after ReadFrame returns a *FrameError, the next call
// discards input until the next "FK"+version marker (and the header checksum
// then rejects false markers found in payload bytes).
type Decoder struct {
	r       *bufio.Reader
	resync  bool
	skipped int64 // bytes discarded while resynchronising
	// maxSkip, if positive, bounds skipped: past it the resync scan stops with a
	// *FrameError instead of reading on, so that a reader which gives up after so many
	// bytes (Client) sees them even when the input never holds a marker.
	maxSkip int64
}

// Skipped returns the number of input bytes discarded so far because they
// were not part of a valid frame.
func (d *Decoder) Skipped() int64 { return d.skipped }

// NewDecoder returns a Decoder reading from r.
func NewDecoder(r io.Reader) *Decoder {
	return &Decoder{r: bufio.NewReaderSize(r, 64<<10)}
}

var marker = []byte{Magic[0], Magic[1], ProtocolVersion}

// ReadFrame returns the next frame. Errors other than *FrameError (I/O
// errors, io.EOF, io.ErrUnexpectedEOF) are terminal.
func (d *Decoder) ReadFrame() (Frame, error) {
	if d.resync {
		if err := d.skipToMarker(); err != nil {
			return Frame{}, err
		}
		d.resync = false
	}
	h, err := d.r.Peek(HeaderSize)
	if err != nil {
		if err == io.EOF && len(h) > 0 {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	t, id, n, err := parseHeader(h)
	if err != nil {
		// Skip one byte so the resync scan cannot match this position again.
		d.r.Discard(1)
		d.skipped++
		d.resync = true
		return Frame{}, err
	}
	d.r.Discard(HeaderSize)
	f := Frame{Type: t, Stream: id, Payload: make([]byte, n)}
	if _, err := io.ReadFull(d.r, f.Payload); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return Frame{}, err
	}
	return f, nil
}

// skipToMarker discards bytes until the buffered input starts with marker.
func (d *Decoder) skipToMarker() error {
	for {
		b, err := d.r.Peek(len(marker))
		if bytes.Equal(b, marker) {
			return nil
		}
		if err != nil {
			if err == io.EOF && len(b) > 0 {
				return io.ErrUnexpectedEOF
			}
			return err
		}
		if d.maxSkip > 0 && d.skipped > d.maxSkip {
			return &FrameError{Err: ErrBadFrame, Reason: fmt.Sprintf("no frame in %d bytes", d.skipped)}
		}
		// Jump to the next candidate 'F' in the buffer, or drop everything.
		buf, _ := d.r.Peek(d.r.Buffered())
		i := bytes.IndexByte(buf[1:], Magic[0])
		if i < 0 {
			d.r.Discard(len(buf))
			d.skipped += int64(len(buf))
		} else {
			d.r.Discard(i + 1)
			d.skipped += int64(i + 1)
		}
	}
}
