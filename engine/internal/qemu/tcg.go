package qemu

import "context"

// XQueryJIT returns the text of QEMU's `info jit` (QMP x-query-jit, TCG only).
func (m *Monitor) XQueryJIT(ctx context.Context) (string, error) {
	var out struct {
		Text string `json:"human-readable-text"`
	}
	err := m.exec(ctx, "x-query-jit", nil, &out)
	return out.Text, err
}
