package api

import (
	"errors"
	"testing"
	"time"
)

func TestProtectOptionsNormalize(t *testing.T) {
	for _, tc := range []struct {
		in, want time.Duration
		err      error
	}{
		{0, DefaultProtectEvery, nil},
		{time.Second, time.Second, nil},
		{24 * time.Hour, 24 * time.Hour, nil},
		{999 * time.Millisecond, 0, ErrInvalidSpec},
		{-time.Second, 0, ErrInvalidSpec},
		{25 * time.Hour, 0, ErrInvalidSpec},
	} {
		o := ProtectOptions{Every: tc.in}
		err := o.Normalize()
		if !errors.Is(err, tc.err) || err == nil && o.Every != tc.want {
			t.Errorf("Every %v: %v, %v; want %v, %v", tc.in, o.Every, err, tc.want, tc.err)
		}
	}
}

func TestProtectionAge(t *testing.T) {
	now := time.Date(2026, 12, 5, 9, 0, 0, 0, time.UTC)
	if a := (&ProtectionInfo{}).Age(now); a != 0 {
		t.Errorf("age without a point: %v", a)
	}
	if a := (&ProtectionInfo{PointAt: now.Add(-3 * time.Second)}).Age(now); a != 3*time.Second {
		t.Errorf("age: %v, want 3s", a)
	}
}
