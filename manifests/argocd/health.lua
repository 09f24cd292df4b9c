-- Argo CD health check for harvest.dev/HarvestJob. Install it under
-- resource.customizations.health.harvest.dev_HarvestJob in argocd-cm (see README.md).
local hs = { status = "Progressing", message = "waiting for the operator" }
if obj.spec ~= nil and obj.spec.suspend == true then
  hs.status = "Suspended"
  hs.message = "the job is suspended"
end
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Finished" and condition.status == "True" then
    -- A cancel is a finished, deliberate end: Healthy, not Suspended, which Argo CD would
    -- show forever because nothing resumes a cancelled job. A copy of a job that ran before
    -- (the same manifest applied again after the TTL deleted it) ends as that run did.
    local ended = string.gsub(condition.reason, "^Already", "")
    if ended == "Succeeded" or ended == "Cancelled" then
      hs.status = "Healthy"
    else
      hs.status = "Degraded"
    end
    hs.message = condition.reason .. ": " .. (condition.message or "")
    return hs
  end
end
-- No account pays for the job: it waits for a person to fix the accounts, not for capacity,
-- so Argo CD shows it Degraded rather than Progressing forever. It turns Progressing, then
-- Healthy, once an account takes it.
local unpaid = { NoAccount = true, UnknownAccount = true, AmbiguousAccount = true }
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Admitted" and condition.status == "False" and hs.status ~= "Suspended" then
    if unpaid[condition.reason] then
      hs.status = "Degraded"
    end
    hs.message = condition.reason .. ": " .. (condition.message or "")
  elseif condition.type == "Running" then
    hs.message = condition.reason .. ": " .. (condition.message or "")
  end
end
return hs
