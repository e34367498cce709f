package qmp

import (
	"encoding/json"
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Use errors.Is to test for them; returned errors usually
// wrap one of these together with the underlying cause.
var (
	// ErrClosed is returned (wrapped) by calls on a client whose connection
	// has ended, and by calls that were pending when it ended.
	ErrClosed = errors.New("qmp: connection closed")
	// ErrHandshake wraps every failure of the greeting / qmp_capabilities
	// exchange in Dial and NewClient.
	ErrHandshake = errors.New("qmp: handshake failed")
	// ErrProtocol reports a message that is not valid QMP.
	ErrProtocol = errors.New("qmp: protocol error")
	// ErrFDPassing is wrapped by *FDPassingError.
	ErrFDPassing = errors.New("qmp: file descriptor passing not supported")
)

// Error is a QMP "error" reply, as returned by Execute. Class is the QMP
// error class (for example "GenericError", "CommandNotFound").
type Error struct {
	Class string `json:"class"`
	Desc  string `json:"desc"`
}

// Error implements the error interface as "qmp: <class>: <desc>".
func (e *Error) Error() string { return "qmp: " + e.Class + ": " + e.Desc }

// FDPassingError is returned by ExecuteFD when the connection cannot carry
// SCM_RIGHTS messages (it is not a *net.UnixConn, or the platform has no
// unix sockets). It wraps ErrFDPassing.
type FDPassingError struct {
	// ConnType is the dynamic type of the connection, e.g. "*net.pipe".
	ConnType string
}

// Error implements the error interface.
func (e *FDPassingError) Error() string {
	return fmt.Sprintf("qmp: file descriptor passing needs a *net.UnixConn, have %s", e.ConnType)
}

// Unwrap returns ErrFDPassing.
func (e *FDPassingError) Unwrap() error { return ErrFDPassing }

// Event is an asynchronous QMP event such as STOP, RESUME or SHUTDOWN.
type Event struct {
	// Name is the event name, e.g. "SHUTDOWN".
	Name string
	// Data is the raw "data" member; nil when the event has none.
	Data json.RawMessage
	// Time is the event's timestamp as reported by QEMU; zero if absent.
	Time time.Time
}

// Version is the QEMU version reported in the QMP greeting.
type Version struct {
	Major, Minor, Micro int
	// Package is the vendor package string, often empty.
	Package string
}

// String formats the version as "major.minor.micro" plus the package, if any.
func (v Version) String() string {
	s := fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Micro)
	if v.Package != "" {
		s += " (" + v.Package + ")"
	}
	return s
}

// msgKind classifies a decoded QMP message.
type msgKind int

const (
	kindInvalid msgKind = iota
	kindGreeting
	kindReply
	kindEvent
)

// greeting is the server's first message.
type greeting struct {
	Version      Version
	Capabilities []string
}

// message is one decoded server message.
type message struct {
	kind     msgKind
	id       string          // reply/event "id" if it is a JSON string, else ""
	ret      json.RawMessage // reply: the "return" member (nil if error)
	err      *Error          // reply: the "error" member (nil if success)
	event    Event           // kindEvent
	greeting greeting        // kindGreeting
}

type wireGreeting struct {
	Version struct {
		QEMU struct {
			Major int `json:"major"`
			Minor int `json:"minor"`
			Micro int `json:"micro"`
		} `json:"qemu"`
		Package string `json:"package"`
	} `json:"version"`
	Capabilities []string `json:"capabilities"`
}

type wireTimestamp struct {
	Seconds      int64 `json:"seconds"`
	Microseconds int64 `json:"microseconds"`
}

func protoErr(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrProtocol}, a...)...)
}

// decodeMessage decodes one complete QMP server message (a JSON object).
// It is a pure function so that it can be fuzzed. On error the returned
// message still carries the id when one could be extracted, so that the
// caller can fail the matching pending command instead of leaving it hung.
// All returned errors wrap ErrProtocol.
func decodeMessage(b []byte) (message, error) {
	var m message
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(b, &obj); err != nil {
		return m, protoErr("not a JSON object: %v", err)
	}
	if obj == nil {
		return m, protoErr("not a JSON object: null")
	}
	if raw, ok := obj["id"]; ok {
		var s string
		if json.Unmarshal(raw, &s) == nil {
			m.id = s
		}
	}
	raw, isGreeting := obj["QMP"]
	if isGreeting {
		var g wireGreeting
		if err := json.Unmarshal(raw, &g); err != nil {
			return m, protoErr("bad greeting: %v", err)
		}
		m.kind = kindGreeting
		m.greeting = greeting{
			Version: Version{
				Major:   g.Version.QEMU.Major,
				Minor:   g.Version.QEMU.Minor,
				Micro:   g.Version.QEMU.Micro,
				Package: g.Version.Package,
			},
			Capabilities: g.Capabilities,
		}
		return m, nil
	}
	if raw, ok := obj["event"]; ok {
		var name string
		if err := json.Unmarshal(raw, &name); err != nil || name == "" {
			return m, protoErr("bad event name %s", truncate(raw))
		}
		ev := Event{Name: name}
		if data, ok := obj["data"]; ok && string(data) != "null" {
			ev.Data = data
		}
		if ts, ok := obj["timestamp"]; ok {
			var t wireTimestamp
			if err := json.Unmarshal(ts, &t); err != nil {
				return m, protoErr("bad event timestamp: %v", err)
			}
			// QEMU reports {-1,-1} when the clock could not be read.
			if t.Seconds >= 0 && t.Microseconds >= 0 && t.Microseconds < 1e6 {
				ev.Time = time.Unix(t.Seconds, t.Microseconds*1000)
			}
		}
		m.kind = kindEvent
		m.event = ev
		return m, nil
	}
	ret, hasRet := obj["return"]
	errRaw, hasErr := obj["error"]
	switch {
	case hasRet && hasErr:
		return m, protoErr("reply has both return and error")
	case hasRet:
		m.kind = kindReply
		m.ret = ret
		return m, nil
	case hasErr:
		var e Error
		if err := json.Unmarshal(errRaw, &e); err != nil {
			return m, protoErr("bad error reply: %v", err)
		}
		if e.Class == "" {
			return m, protoErr("error reply without class")
		}
		m.kind = kindReply
		m.err = &e
		return m, nil
	}
	return m, protoErr("unknown message %s", truncate(b))
}

func truncate(b []byte) string {
	const max = 128
	if len(b) > max {
		return string(b[:max]) + "..."
	}
	return string(b)
}
