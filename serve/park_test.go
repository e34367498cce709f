package serve

import (
	"sync"
	"testing"
	"time"
)

// TestWakeLocksForgotten: the daemon keeps a wake lock of a VM only while a request
// holds or waits for it. A park or wake of a name that is no VM (any name a client
// sends, up to the URL's length) left its lock in the map for the daemon's life, as did
// every VM deleted since it was served.
func TestWakeLocksForgotten(t *testing.T) {
	s, hc, _ := newTestServer(t)
	for _, c := range []struct {
		method, path string
		status       int
	}{
		{"POST", "/v1/vms/nope/park", 404},
		{"POST", "/v1/vms/nope2/wake", 404},
		{"POST", "/v1/vms/a%2Fb/park", 400},
		{"POST", "/v1/vms/nope3/exec", 404},
		{"GET", "/v1/vms/nope4/logs?follow=1", 404},
	} {
		if status, o, _ := request(t, hc, c.method, c.path, `{"argv":["true"]}`); status != c.status {
			t.Errorf("%s %s: HTTP %d %s, want %d", c.method, c.path, status, o.Code, c.status)
		}
	}
	s.holdParked("nope5")
	if n := waking(s); n != 0 {
		t.Errorf("%d wake locks left after requests for no VM", n)
	}

	// The lock still excludes: a second holder waits for the first, and neither leaves
	// anything behind.
	unlock := s.pk.lockWake("vm")
	if _, ok := s.pk.tryLockWake("vm"); ok {
		t.Fatal("tryLockWake took a held lock")
	}
	got := make(chan struct{})
	go func() {
		u := s.pk.lockWake("vm")
		close(got)
		u()
	}()
	select {
	case <-got:
		t.Fatal("lockWake took a held lock")
	case <-time.After(50 * time.Millisecond):
	}
	unlock()
	<-got
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if u, ok := s.pk.tryLockWake("vm"); ok {
				u()
			}
			s.pk.lockWake("vm")()
		}()
	}
	wg.Wait()
	if n := waking(s); n != 0 {
		t.Errorf("%d wake locks left after their holders unlocked", n)
	}
}

func waking(s *Server) int {
	s.pk.mu.Lock()
	defer s.pk.mu.Unlock()
	return len(s.pk.waking)
}

// TestParkerDrop: a deleted VM's last use is forgotten (a daemon without idle parking
// never prunes it otherwise), unless a request still uses the name.
func TestParkerDrop(t *testing.T) {
	s, _, _ := newTestServer(t)
	p := s.pk
	p.touch("gone")
	done := p.enter("used")
	p.drop("gone")
	p.drop("used")
	p.mu.Lock()
	_, gone := p.last["gone"]
	_, used := p.last["used"]
	p.mu.Unlock()
	if gone || !used {
		t.Errorf("after drop: gone kept %v, used kept %v; want false, true", gone, used)
	}
	done()
	p.drop("used")
	p.mu.Lock()
	n := len(p.last)
	p.mu.Unlock()
	if n != 0 {
		t.Errorf("%d last-use entries left", n)
	}
}
