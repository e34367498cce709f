package bench

import (
	"errors"
	"testing"
)

// TestSurviveSettingsCheck: the survive bench's settings are refused before anything
// starts when a number is out of range or the fault or victim is unknown.
func TestSurviveSettingsCheck(t *testing.T) {
	ok := SurviveSettings{N: 6, EveryS: 5, WriteMBPerMin: 20, HoldS: 30, Fault: "kill", Victim: "last"}
	for _, tc := range []struct {
		name string
		mod  func(*SurviveSettings)
		ok   bool
	}{
		{"defaults", func(*SurviveSettings) {}, true},
		{"leader", func(s *SurviveSettings) { s.Victim = "leader" }, true},
		{"cut", func(s *SurviveSettings) { s.Fault, s.CutS = "cut", 18 }, true},
		{"unknown victim", func(s *SurviveSettings) { s.Victim = "n2" }, false},
		{"no victim", func(s *SurviveSettings) { s.Victim = "" }, false},
		{"unknown fault", func(s *SurviveSettings) { s.Fault = "pause" }, false},
		{"cut without a length", func(s *SurviveSettings) { s.Fault = "cut" }, false},
		{"hold shorter than an interval", func(s *SurviveSettings) { s.HoldS = 1 }, false},
		{"too many forks", func(s *SurviveSettings) { s.N = 65 }, false},
	} {
		s := ok
		tc.mod(&s)
		err := s.Check()
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, ErrFleetArgs)) {
			t.Errorf("%s: %v, want ok %v (else ErrFleetArgs)", tc.name, err, tc.ok)
		}
	}
}
