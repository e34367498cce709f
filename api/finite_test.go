package api

import (
	"errors"
	"math"
	"testing"
)

// TestValidateOvercommit: NaN, ±Inf and negatives are ErrInvalidSpec; 0 and positive
// finite values pass.
func TestValidateOvercommit(t *testing.T) {
	for _, tc := range []struct {
		v  float64
		ok bool
	}{
		{0, true}, {1.5, true}, {16, true},
		{math.NaN(), false}, {math.Inf(1), false}, {math.Inf(-1), false}, {-1, false},
	} {
		err := ValidateOvercommit(tc.v)
		if tc.ok != (err == nil) || err != nil && !errors.Is(err, ErrInvalidSpec) {
			t.Errorf("ValidateOvercommit(%v) = %v", tc.v, err)
		}
	}
}
