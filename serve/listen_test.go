package serve

import (
	"errors"
	"testing"
)

// TestCheckTCPAddr: an API address that is not loopback needs public (0.0.0.0:P bound
// every interface without a word).
func TestCheckTCPAddr(t *testing.T) {
	for _, tc := range []struct {
		addr   string
		public bool
		want   error // nil: accepted
		bad    bool  // refused for another reason (unparsable)
	}{
		{addr: "127.0.0.1:7070"}, {addr: "[::1]:7070"}, {addr: "localhost:7070"}, {addr: "127.0.0.2:7070"},
		{addr: "0.0.0.0:7070", want: ErrNotLoopback}, {addr: ":7070", want: ErrNotLoopback}, {addr: "[::]:7070", want: ErrNotLoopback},
		{addr: "192.168.1.5:7070", want: ErrNotLoopback}, {addr: "example.com:7070", want: ErrNotLoopback},
		{addr: "0.0.0.0:7070", public: true}, {addr: ":7070", public: true},
		{addr: "nonsense", public: true, bad: true},
	} {
		err := CheckTCPAddr(tc.addr, tc.public)
		switch {
		case tc.bad && err == nil, !tc.bad && tc.want == nil && err != nil, tc.want != nil && !errors.Is(err, tc.want):
			t.Errorf("CheckTCPAddr(%q, %v) = %v, want %v (unparsable: %v)", tc.addr, tc.public, err, tc.want, tc.bad)
		}
	}
}
