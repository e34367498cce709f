package report

import (
	"time"

	"github.com/forkvm/forkvm/engine"
)

// Phases are a fork's phase durations (engine.PhaseTimings without the JSON tags).
type Phases struct{ Prepare, Spawn, Restore, Agent time.Duration }

// PhasesOf is the phases of t.
func PhasesOf(t engine.PhaseTimings) Phases { return Phases{t.Prepare, t.Spawn, t.Restore, t.Agent} }
