package api

import (
	"fmt"
	"time"
)

// Protection bounds and default (ProtectOptions.Every).
const (
	DefaultProtectEvery = 5 * time.Second
	MinProtectEvery     = time.Second
	MaxProtectEvery     = 24 * time.Hour
)

// ProtectOptions tune a VM's protection (engine.Engine.Protect; the daemon's
// POST /v1/vms/NAME/protect). A nil *ProtectOptions means defaults.
type ProtectOptions struct {
	// Every is the interval between protection points (0: DefaultProtectEvery).
	Every time.Duration `json:"every_ns,omitempty"`
}

// Normalize fills the defaults and checks the bounds (ErrInvalid).
func (o *ProtectOptions) Normalize() error {
	if o.Every == 0 {
		o.Every = DefaultProtectEvery
	}
	if o.Every < MinProtectEvery || o.Every > MaxProtectEvery {
		return fmt.Errorf("%w: a protection interval is %v to %v, not %v", ErrInvalidSpec, MinProtectEvery, MaxProtectEvery, o.Every)
	}
	return nil
}

// ProtectionInfo is a protected VM's protection (Info.Protection): its interval, its
// last complete protection point (a checkpoint the VM can be revived from as itself,
// copied wherever the engine's ProtectionCopier puts it) and how it fares.
type ProtectionInfo struct {
	Every time.Duration `json:"every_ns"`
	// Point is the last complete protection point ("" until the first completes) and
	// PointAt when its guest was stopped: the work a revival loses is what the VM did
	// since.
	Point   string    `json:"point,omitempty"`
	PointAt time.Time `json:"point_at,omitzero"`
	// Points counts the points completed since protection began; Failures those that
	// failed (LastError says why the last one did).
	Points    int64  `json:"points"`
	Failures  int64  `json:"failures,omitempty"`
	LastError string `json:"last_error,omitempty"`
	// Behind is set while the last point took longer than the interval: its age then
	// grows past Every.
	Behind bool `json:"behind,omitempty"`
	// LastPause is the guest's pause for the last point; LastBytes the point's own
	// pages and device state.
	LastPause time.Duration `json:"last_pause_ns,omitempty"`
	LastBytes int64         `json:"last_bytes,omitempty"`
}

// Age is how old the last complete point is at now (0 without one).
func (p *ProtectionInfo) Age(now time.Time) time.Duration {
	if p.PointAt.IsZero() {
		return 0
	}
	return now.Sub(p.PointAt)
}
