package api

import (
	"fmt"
	"math"
)

// CheckFinite refuses a float input that is NaN or ±Inf with an error wrapping
// ErrInvalidSpec naming what: every comparison with NaN is false, so a bound check such
// as v < 0 lets it through to arithmetic (an int conversion of it is undefined), and
// encoding/json cannot send either on the wire. Callers check before any work.
func CheckFinite(what string, v float64) error {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return fmt.Errorf("%w: %s must be a finite number (got %v)", ErrInvalidSpec, what, v)
	}
	return nil
}

// ValidateOvercommit checks a request's vCPU overcommit (ForkOptions.Overcommit,
// ManyOptions.Overcommit): finite and not negative (0 means the engine's); an error
// wrapping ErrInvalidSpec otherwise.
func ValidateOvercommit(v float64) error {
	if err := CheckFinite("overcommit", v); err != nil {
		return err
	}
	if v < 0 {
		return fmt.Errorf("%w: overcommit must not be negative (got %g)", ErrInvalidSpec, v)
	}
	return nil
}
