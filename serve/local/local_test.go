package local

import (
	"fmt"
	"testing"
	"time"

	"github.com/forkvm/forkvm/api"
	"github.com/forkvm/forkvm/engine"
)

// TestForkEventsBuffered: Local.ForkMany's events have room for the whole wave, however
// its count was given, so that the goroutine forwarding the engine's events ends while
// nobody reads them (a caller that stops reading leaks nothing): the engine's channel
// sized for 3 forks (n 0, three Names) is forwarded whole before a read, and then read
// in order, closed.
func TestForkEventsBuffered(t *testing.T) {
	for _, n := range []int{0, 1, 3} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			evs := make(chan engine.ForkEvent, n) // as the engine's ForkMany sizes it
			for i := range n {
				evs <- engine.ForkEvent{ForkEvent: api.ForkEvent{Index: i, Name: fmt.Sprint("f", i)}}
			}
			close(evs)
			out := forkEvents(evs)
			deadline := time.Now().Add(10 * time.Second)
			for len(out) < n && time.Now().Before(deadline) {
				time.Sleep(time.Millisecond)
			}
			if len(out) != n {
				t.Fatalf("%d of %d events forwarded without a reader (room for %d)", len(out), n, cap(out))
			}
			for i := range n {
				if ev := <-out; ev.Index != i || ev.Name != fmt.Sprint("f", i) {
					t.Errorf("event %d: %+v", i, ev)
				}
			}
			select {
			case ev, ok := <-out:
				if ok {
					t.Errorf("an extra event: %+v", ev)
				}
			case <-time.After(10 * time.Second):
				t.Error("events not closed")
			}
		})
	}
}
