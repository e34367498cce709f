package qmp

import (
	"encoding/json"
	"errors"
	"testing"
	"time"
)

func TestDecodeMessage(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		kind    msgKind
		id      string
		check   func(t *testing.T, m message)
		wantErr bool
	}{
		{name: "greeting", in: testGreeting, kind: kindGreeting, check: func(t *testing.T, m message) {
			if m.greeting.Version != (Version{10, 0, 2, "Debian 1:10.0.2"}) {
				t.Errorf("version %+v", m.greeting.Version)
			}
		}},
		{name: "return object", in: `{"return": {"running": true}, "id": "fk-3"}`, kind: kindReply, id: "fk-3", check: func(t *testing.T, m message) {
			if string(m.ret) != `{"running": true}` || m.err != nil {
				t.Errorf("ret %s err %v", m.ret, m.err)
			}
		}},
		{name: "return null", in: `{"return": null, "id": "fk-1"}`, kind: kindReply, id: "fk-1", check: func(t *testing.T, m message) {
			if string(m.ret) != "null" {
				t.Errorf("ret %q", m.ret)
			}
		}},
		{name: "return without id", in: `{"return": []}`, kind: kindReply},
		{name: "numeric id", in: `{"return": {}, "id": 7}`, kind: kindReply, id: ""},
		{name: "error", in: `{"error": {"class": "GenericError", "desc": "x"}, "id": "fk-9"}`, kind: kindReply, id: "fk-9", check: func(t *testing.T, m message) {
			if m.err == nil || *m.err != (Error{"GenericError", "x"}) || m.ret != nil {
				t.Errorf("err %+v ret %s", m.err, m.ret)
			}
		}},
		{name: "event", in: `{"event": "STOP", "timestamp": {"seconds": 1700000000, "microseconds": 250}}`, kind: kindEvent, check: func(t *testing.T, m message) {
			if m.event.Name != "STOP" || m.event.Data != nil || !m.event.Time.Equal(time.Unix(1700000000, 250000)) {
				t.Errorf("event %+v", m.event)
			}
		}},
		{name: "event bad clock", in: `{"event": "X", "data": {}, "timestamp": {"seconds": -1, "microseconds": -1}}`, kind: kindEvent, check: func(t *testing.T, m message) {
			if !m.event.Time.IsZero() || string(m.event.Data) != "{}" {
				t.Errorf("event %+v", m.event)
			}
		}},
		{name: "error with id keeps id", in: `{"error": 5, "id": "fk-2"}`, id: "fk-2", wantErr: true},
		{name: "both", in: `{"return": {}, "error": {"class":"a","desc":"b"}}`, wantErr: true},
		{name: "error without class", in: `{"error": {"desc": "b"}}`, wantErr: true},
		{name: "empty event name", in: `{"event": ""}`, wantErr: true},
		{name: "event name not string", in: `{"event": 1}`, wantErr: true},
		{name: "bad timestamp", in: `{"event": "X", "timestamp": "now"}`, wantErr: true},
		{name: "bad greeting", in: `{"QMP": []}`, wantErr: true},
		{name: "unknown", in: `{"hello": 1}`, wantErr: true},
		{name: "array", in: `[1,2]`, wantErr: true},
		{name: "null", in: `null`, wantErr: true},
		{name: "truncated", in: `{"return": {`, wantErr: true},
		{name: "empty", in: ``, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := decodeMessage([]byte(tt.in))
			if tt.wantErr {
				if !errors.Is(err, ErrProtocol) {
					t.Fatalf("err = %v, want ErrProtocol", err)
				}
			} else if err != nil {
				t.Fatalf("err = %v", err)
			} else if m.kind != tt.kind {
				t.Errorf("kind = %d, want %d", m.kind, tt.kind)
			}
			if m.id != tt.id {
				t.Errorf("id = %q, want %q", m.id, tt.id)
			}
			if tt.check != nil {
				tt.check(t, m)
			}
		})
	}
}

// FuzzDecode checks that decodeMessage never panics, that it classifies
// every accepted message consistently, and that failures wrap ErrProtocol.
// The seed corpus lives in testdata/fuzz/FuzzDecode.
func FuzzDecode(f *testing.F) {
	f.Add([]byte(testGreeting))
	f.Add([]byte(`{"return": {}, "id": "fk-1"}`))
	f.Add([]byte(`{"event": "SHUTDOWN", "data": {"guest": false}, "timestamp": {"seconds": 1, "microseconds": 2}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMessage(b)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error %v does not wrap ErrProtocol", err)
			}
			return
		}
		if !json.Valid(b) {
			t.Fatalf("accepted invalid JSON %q", b)
		}
		switch m.kind {
		case kindGreeting:
		case kindReply:
			if (m.ret == nil) == (m.err == nil) {
				t.Fatalf("reply must have exactly one of return/error: %+v", m)
			}
			if m.ret != nil && !json.Valid(m.ret) {
				t.Fatalf("invalid return JSON %q", m.ret)
			}
			if m.err != nil && m.err.Class == "" {
				t.Fatalf("error without class")
			}
		case kindEvent:
			if m.event.Name == "" {
				t.Fatalf("event without name")
			}
			if m.event.Data != nil && !json.Valid(m.event.Data) {
				t.Fatalf("invalid event data %q", m.event.Data)
			}
		default:
			t.Fatalf("accepted message with kind %d", m.kind)
		}
	})
}
