package api

// ImageSchema names the root image object that `forkvm images --json` and `forkvm
// image create --json` print (guest.RootImage's fields with a schema name). Its
// fields are snake_case like every other object here; before it had a schema the
// CLI printed diskBytes, contentBytes and agentSha256.
const ImageSchema = "forkvm.image/v1"
