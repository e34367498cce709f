package serve

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"
)

// TestStoppingCause: a request still running when the daemon's grace ends is cancelled
// with ErrStopping as the cause, and an exec error made of that cancellation says the
// daemon stopped (it printed only "context canceled"); a client's own cancellation is
// left alone.
func TestStoppingCause(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	started := make(chan struct{})
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		close(started)
		<-r.Context().Done()
		got <- stoppingErr(r, context.Canceled)
	})
	ctx, stop := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, ln, h, 50*time.Millisecond) }()
	go http.Get("http://" + ln.Addr().String() + "/")
	<-started
	stop()
	select {
	case err := <-got:
		if !errors.Is(err, ErrStopping) || !errors.Is(err, context.Canceled) || !strings.Contains(err.Error(), "daemon is stopping") {
			t.Errorf("exec error at shutdown: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request was not cancelled")
	}
	<-done
	r, _ := http.NewRequest("GET", "/", nil)
	cctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := stoppingErr(r.WithContext(cctx), context.Canceled); err != context.Canceled {
		t.Errorf("a client's cancellation became %v", err)
	}
}
