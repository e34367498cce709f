package api

import "time"

// ImageSchema names the root image object that `forkvm images --json` and `forkvm
// image create --json` print (guest.RootImage's fields with a schema name). Its
// fields are snake_case like every other object here; before it had a schema the
// CLI printed diskBytes, contentBytes and agentSha256.
const ImageSchema = "forkvm.image/v1"

// BootCacheSchema names the boot cache entry object that `forkvm boot-cache --json`
// prints.
const BootCacheSchema = "forkvm.boot-cache-entry/v1"

// BootCacheEntry is one boot the host's boot cache holds (engine.ListBootCache).
type BootCacheEntry struct {
	// Key names the entry: a digest of the boot's shape, or for an entry set aside as
	// damaged, its directory's name (damaged-KEY-TIME).
	Key string `json:"key"`
	// From is the VM whose boot it is.
	From string `json:"from,omitempty"`
	// CreatedAt is when the boot was kept, UsedAt when a VM was last restored from it.
	CreatedAt time.Time `json:"created_at"`
	UsedAt    time.Time `json:"used_at"`
	// Bytes is the data its files hold on disk.
	Bytes int64 `json:"bytes"`
	// Damaged marks an entry set aside: no VM is restored from it.
	Damaged bool `json:"damaged,omitempty"`
}
