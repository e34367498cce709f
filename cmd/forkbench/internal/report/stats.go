package report

import (
	"math"
	"sort"
	"time"
)

// Percentiles summarises a sample set. Values are in the unit of the input.
type Percentiles struct {
	P50 float64 `json:"p50"`
	P90 float64 `json:"p90"`
	P95 float64 `json:"p95"`
	P99 float64 `json:"p99"`
	Min float64 `json:"min"`
	Max float64 `json:"max"`
	// ForkMSP50, ForkMSP95 and ForkMSMax repeat the headline wave's fork latencies under
	// the published result's names (fanout only; omitted when 0).
	ForkMSP50 float64 `json:"fork_ms_p50,omitempty"`
	ForkMSP95 float64 `json:"fork_ms_p95,omitempty"`
	ForkMSMax float64 `json:"fork_ms_max,omitempty"`
}

// Percentile returns the q-th percentile (0..100) of xs by linear interpolation between
// closest ranks (the definition numpy uses by default). xs need not be sorted; an empty
// set gives 0.
func Percentile(xs []float64, q float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return percentileSorted(s, q)
}

func percentileSorted(s []float64, q float64) float64 {
	if len(s) == 0 {
		return 0
	}
	q = math.Max(0, math.Min(100, q))
	pos := q / 100 * float64(len(s)-1)
	lo := int(math.Floor(pos))
	hi := int(math.Ceil(pos))
	if lo == hi {
		return s[lo]
	}
	frac := pos - float64(lo)
	return s[lo] + (s[hi]-s[lo])*frac
}

// Summarize computes every percentile of xs.
func Summarize(xs []float64) Percentiles {
	if len(xs) == 0 {
		return Percentiles{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	return Percentiles{
		P50: percentileSorted(s, 50), P90: percentileSorted(s, 90), P95: percentileSorted(s, 95),
		P99: percentileSorted(s, 99), Min: s[0], Max: s[len(s)-1],
	}
}

// Median is the 50th percentile.
func Median(xs []float64) float64 { return Percentile(xs, 50) }

// Ms converts a duration to float milliseconds.
func Ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// Round3 rounds to 3 decimals (keeps JSON readable).
func Round3(x float64) float64 { return math.Round(x*1000) / 1000 }

// Ratio returns a/b, or 0 when b is 0.
func Ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
