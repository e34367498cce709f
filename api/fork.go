package api

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"strconv"
	"time"

	"github.com/forkvm/forkvm/internal/names"
)

// MaxNameLen bounds VM and checkpoint names (they become file and socket names).
const MaxNameLen = 48

// MaxForks bounds n of one request for forks (ValidateForkCount): of the engine's
// ForkMany, of the daemon's POST /v1/forks and of forkvm fork --n. It bounds what one
// request may ask for (its names, events and forwards are held at once), not how many
// forks run: admission bounds those by the host's budget.
const MaxForks = 4096

// MaxFleetForks bounds n of one fleet wave (FleetForkRequest.Validate): its forks are
// spread over the fleet's nodes, each admitting its share.
const MaxFleetForks = 100000

// MaxPublish bounds the port forwards of one VM.
const MaxPublish = 64

// ValidateName checks a VM or checkpoint name: 1..MaxNameLen characters of
// [A-Za-z0-9_.-], starting with a letter or digit. Such names cannot contain commas
// (QEMU option separators), slashes, NUL or "..", so they can be used in paths and
// QEMU options without escaping.
func ValidateName(name string) error {
	if err := names.Check(name, MaxNameLen); err != nil {
		return fmt.Errorf("%w: %w", ErrInvalidName, err)
	}
	return nil
}

// ValidateForkCount checks n, the number of forks of one request: 1..MaxForks.
func ValidateForkCount(n int) error { return validateCount(n, MaxForks) }

// validateCount checks n against 1..limit.
func validateCount(n, limit int) error {
	if n < 1 || n > limit {
		return fmt.Errorf("%w: n must be 1..%d, got %d", ErrInvalidSpec, limit, n)
	}
	return nil
}

// WaveForwards is what fork i of a wave publishes when the wave asks for pubs: each
// forward with its host port shifted by i, so that the wave's forks publish
// consecutive host ports (8080:80 gives fork 0 8080, fork 1 8081...). A shifted port
// past 65535 is ErrInvalidSpec.
func WaveForwards(pubs []PortForward, i int) ([]PortForward, error) {
	var out []PortForward
	for _, p := range pubs {
		p.HostPort += i
		if err := p.Validate(); err != nil {
			return nil, fmt.Errorf("fork %d of the wave: %w", i, err)
		}
		out = append(out, p)
	}
	return out, nil
}

// ValidatePublish checks one VM's forwards: at most MaxPublish, each valid, no host
// address bound twice.
func ValidatePublish(pubs []PortForward) error {
	if len(pubs) > MaxPublish {
		return fmt.Errorf("%w: %d published ports (at most %d)", ErrInvalidSpec, len(pubs), MaxPublish)
	}
	return validatePublishMany(pubs)
}

// validatePublishMany checks forwards (one VM's, or a whole wave's): each valid, no
// host address bound twice (0.0.0.0 overlaps every address on the same port).
func validatePublishMany(all []PortForward) error {
	seen := map[int][]string{}
	for _, p := range all {
		if err := p.Validate(); err != nil {
			return err
		}
		for _, ip := range seen[p.HostPort] {
			if ip == p.BindIP() || ip == "0.0.0.0" || p.BindIP() == "0.0.0.0" {
				return fmt.Errorf("%w: host port %s published twice", ErrInvalidSpec, p.BindIP()+":"+strconv.Itoa(p.HostPort))
			}
		}
		seen[p.HostPort] = append(seen[p.HostPort], p.BindIP())
	}
	return nil
}

// DerivedName is a fresh name for something made from base: base, then kind (if any),
// then a random tag of six hex digits, base shortened so that room more bytes still fit
// MaxNameLen (a wave's fork numbers). It is how the engine names what a request left
// unnamed: a fork ("SRC-TAG"), a wave's prefix ("SRC-TAG-"), an implicit checkpoint.
func DerivedName(base, kind string, room int) string {
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	suffix := "-" + hex.EncodeToString(b)
	if kind != "" {
		suffix = "-" + kind + suffix
	}
	if limit := MaxNameLen - room - len(suffix); len(base) > limit {
		base = base[:max(limit, 0)]
	}
	return base + suffix
}

// ForkRequestOf is the request for n forks of src that the Go API's options make
// (opts may be nil): Names, when set, also give the count when n is 0, and beat Prefix;
// opts.Publish is called for each index, once n is known to be 1..MaxForks. The
// request still needs Validate.
func ForkRequestOf(src string, n int, opts *ManyOptions) (ForkRequest, error) {
	var o ManyOptions
	if opts != nil {
		o = *opts
	}
	if n == 0 && len(o.Names) > 0 {
		n = len(o.Names) // the names say how many: no count to keep in step with them
	}
	if err := ValidateForkCount(n); err != nil {
		return ForkRequest{}, err
	}
	r := ForkRequest{Source: src, N: n, Prefix: o.Prefix, Concurrency: o.Concurrency, Overcommit: o.Overcommit, Pin: o.Pin, NoPark: o.NoPark}
	if o.Names != nil {
		if len(o.Names) != n {
			return ForkRequest{}, fmt.Errorf("%w: %d names for %d forks", ErrInvalidSpec, len(o.Names), n)
		}
		r.Names, r.Prefix = append([]string(nil), o.Names...), "" // not the caller's slice
	}
	if o.Publish != nil {
		r.Publish = make([][]PortForward, n)
		for i := range r.Publish {
			r.Publish[i] = append([]PortForward(nil), o.Publish(i)...)
		}
	}
	return r, nil
}

// Normalize gives a request its defaults, so that every layer that reads it afterwards
// (the CLI, the client, the daemon, the engine) sees the same forks under the same
// names: N 0 is len(Names), else 1; Name becomes Names; a request naming none of its
// forks gets the engine's names, drawn here once: a single fork SRC-TAG, a wave
// SRC-TAG-1..SRC-TAG-N, with one random TAG (DerivedName) and SRC shortened to fit
// MaxNameLen. A random tag, not the next free number, so that the names depend on the
// request alone: two waves of one checkpoint, on one host or on a fleet's nodes, never
// race for the same names, and a reader whose stream broke knows every name it asked
// for. Normalize of a normalized request changes nothing; it never makes an invalid
// request valid (Validate checks the fields Normalize reads first).
func (r *ForkRequest) Normalize() {
	if r.N == 0 {
		r.N = max(len(r.Names), 1)
	}
	if r.Name != "" && len(r.Names) == 0 && r.Prefix == "" && r.N == 1 {
		r.Names, r.Name = []string{r.Name}, ""
	}
	if len(r.Names) > 0 || r.Prefix != "" || r.Name != "" || ValidateName(r.Source) != nil {
		return
	}
	if r.N == 1 {
		r.Names = []string{DerivedName(r.Source, "", 0)}
		return
	}
	// Room for the fork numbers after the derived prefix, so every name keeps SRC's
	// part whole.
	r.Prefix = DerivedName(r.Source, "", 1+len(strconv.Itoa(r.N))) + "-"
}

// Validate checks a fork request before any fork starts, with the rules every layer
// shares (each error wraps ErrInvalidSpec or ErrInvalidName):
//
//   - Source is a valid name;
//   - N is 0 (one fork, or len(Names)) or 1..MaxForks;
//   - Name, Names and Prefix are exclusive; Name names a single fork; Names are N
//     valid, distinct names; Prefix names the forks Prefix1..PrefixN, each valid;
//   - Publish has at most N lists, each fork's forwards are valid (ValidatePublish)
//     and no host address is published twice in the request;
//   - Concurrency and Overcommit are not negative, and Overcommit is a number.
//
// It reads nothing of a host: whether the source exists, has a network, and whether
// its forks fit are the engine's to say.
func (r ForkRequest) Validate() error { return r.validate(MaxForks) }

// validate is Validate with n bounded by maxForks (a fleet wave's bound is its own).
func (r ForkRequest) validate(maxForks int) error {
	// An empty source is an invalid name, as an empty name is in every other call.
	if err := ValidateName(r.Source); err != nil {
		return fmt.Errorf("source: %w", err)
	}
	if err := r.validateNaming(); err != nil {
		return err
	}
	prefix := r.Prefix // the caller's: Normalize derives one for an unnamed wave
	r.Normalize()
	if err := validateCount(r.N, maxForks); err != nil {
		return err
	}
	if prefix != "" {
		if err := validatePrefix(prefix, r.N); err != nil {
			return err
		}
	}
	if len(r.Names) > 0 && len(r.Names) != r.N {
		return fmt.Errorf("%w: %d names for %d forks", ErrInvalidSpec, len(r.Names), r.N)
	}
	seen := make(map[string]bool, r.N)
	for i := range r.N {
		nm := r.ForkName(i)
		if err := ValidateName(nm); err != nil {
			return err
		}
		if seen[nm] {
			return fmt.Errorf("%w: duplicate name %s", ErrInvalidSpec, nm)
		}
		seen[nm] = true
	}
	if err := r.validatePublish(); err != nil {
		return err
	}
	if r.Concurrency < 0 {
		return fmt.Errorf("%w: concurrency must not be negative (got %d)", ErrInvalidSpec, r.Concurrency)
	}
	return ValidateOvercommit(r.Overcommit)
}

// validatePrefix checks a caller's prefix of n forks, naming it: the check of each
// fork's name named the first one made of it ("a,b1" for prefix "a,b"), or for a name
// too long, the first one cut short, neither of which the caller typed. A prefix that
// is a valid name makes valid names with any number after it; the last one, prefix and
// n, must still fit MaxNameLen.
func validatePrefix(prefix string, n int) error {
	if err := names.Check(prefix, MaxNameLen); err != nil {
		return fmt.Errorf("%w: prefix %w", ErrInvalidName, err)
	}
	if last := prefix + strconv.Itoa(n); len(last) > MaxNameLen {
		return fmt.Errorf("%w: prefix %q is too long for %d forks: %s, the last fork's name, is longer than %d characters", ErrInvalidName, prefix, n, last, MaxNameLen)
	}
	return nil
}

// validateNaming checks how the request names its forks, before Normalize folds Name
// into Names.
func (r ForkRequest) validateNaming() error {
	switch {
	case r.Name != "" && r.N > 1:
		return fmt.Errorf("%w: name names a single fork (n 1); use prefix or names for n > 1", ErrInvalidSpec)
	case r.Name != "" && r.Prefix != "", r.Name != "" && len(r.Names) > 0, r.Prefix != "" && len(r.Names) > 0:
		return fmt.Errorf("%w: name, names and prefix are exclusive", ErrInvalidSpec)
	}
	return nil
}

// validatePublish checks the request's forwards: each fork's, and the request's
// together (no host address twice in a wave).
func (r ForkRequest) validatePublish() error {
	if len(r.Publish) > r.N {
		return fmt.Errorf("%w: publish has %d lists for n %d", ErrInvalidSpec, len(r.Publish), r.N)
	}
	var all []PortForward
	for _, pubs := range r.Publish {
		if err := ValidatePublish(pubs); err != nil {
			return err
		}
		all = append(all, pubs...)
	}
	return validatePublishMany(all)
}

// ForkName is the name of the request's fork i (0-based) once normalized: Names[i], or
// Prefix and i+1.
func (r ForkRequest) ForkName(i int) string {
	if i < len(r.Names) {
		return r.Names[i]
	}
	return r.Prefix + strconv.Itoa(i+1)
}

// ForkNames are the names of all N forks of a normalized request, in index order.
func (r ForkRequest) ForkNames() []string {
	out := make([]string, r.N)
	for i := range out {
		out[i] = r.ForkName(i)
	}
	return out
}

// ForkPublish is fork i's forwards (nil: none).
func (r ForkRequest) ForkPublish(i int) []PortForward {
	if i < len(r.Publish) {
		return r.Publish[i]
	}
	return nil
}

// Options are the Go API's options for the request (API.ForkMany with Source and N):
// what a daemon hands its engine.
func (r ForkRequest) Options() *ManyOptions {
	o := &ManyOptions{Names: r.Names, Prefix: r.Prefix, Concurrency: r.Concurrency, Overcommit: r.Overcommit, Pin: r.Pin, NoPark: r.NoPark}
	if r.Name != "" {
		o.Names = []string{r.Name}
	}
	if len(r.Publish) > 0 {
		o.Publish = r.ForkPublish
	}
	return o
}

// Object is the event as a line of a fork stream (forkvm.fork-event/v1).
func (e ForkEvent) Object() ForkEventObject {
	o := ForkEventObjectOf(e.Index, e.Name, e.Latency, e.VM, e.Err)
	if e.Err == nil {
		o.Faults = e.Faults
	}
	return o
}

// Event is the fork event a stream's line stands for; err is the failed fork's error
// as its reader maps Code back to a sentinel (ignored for a ready fork).
func (o ForkEventObject) Event(err error) ForkEvent {
	ev := ForkEvent{Index: o.Index, Name: o.Name, Latency: time.Duration(o.LatencyMS * float64(time.Millisecond))}
	if o.OK && o.VM != nil {
		inf := o.VM.Info
		ev.VM, ev.Timings, ev.Spans, ev.Counters, ev.Faults = &inf, inf.Timings, inf.Spans, inf.Counters, o.Faults
		if ev.Faults == nil {
			ev.Faults = inf.Faults
		}
	} else {
		ev.Err = err
	}
	return ev
}
