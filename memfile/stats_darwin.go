package memfile

// Residency is not implemented on darwin; it returns ErrUnsupported.
func Residency(path string) (*ResidencyStats, error) { return nil, ErrUnsupported }

// MemAvailable is not implemented on darwin; it returns ErrUnsupported.
func MemAvailable() (int64, error) { return 0, ErrUnsupported }

// ProcessMappings is not implemented on darwin; it returns ErrUnsupported.
func ProcessMappings(pid int) ([]Mapping, error) { return nil, ErrUnsupported }

// ProcessPageTables is not implemented on darwin; it returns ErrUnsupported.
func ProcessPageTables(pid int) (int64, error) { return 0, ErrUnsupported }
