//! The outbox ([`crate::store::outbox`]): a persistent znode per parcel
//! under `{base}/outbox`, named by its id; a parcel is taken by the delete
//! of its znode at the version read, which one taker alone can make.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

#[async_trait]
impl Outbox for ZkStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        if parcels.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        // A store prepared by a version without the outbox has no
        // directory for it yet.
        let dir = self.paths.dir(Kind::Outbox);
        self.timed(client.mkdir(&dir, &persistent)).await?;
        for p in parcels {
            let path = self.paths.of(Kind::Outbox, &p.id);
            match self
                .within(client.create(&path, p.body.as_bytes(), &persistent))
                .await?
            {
                Ok(_) => {}
                Err(zk::Error::NodeExists) => {
                    self.timed(client.set_data(&path, p.body.as_bytes(), None))
                        .await?;
                }
                Err(e) => return Err(self.err(e)),
            }
        }
        Ok(())
    }

    async fn take_handed_over(
        &self,
        _taker: &Owner,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let client = self.client().await?;
        let mut ids = match self
            .timed(client.list_children(&self.paths.dir(Kind::Outbox)))
            .await
        {
            Ok(ids) => ids,
            Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        ids.sort();
        let mut taken = Vec::new();
        for id in ids.into_iter().take(max) {
            let path = self.paths.of(Kind::Outbox, &id);
            let step = async {
                let (data, stat) = match self.within(client.get_data(&path)).await? {
                    Ok(read) => read,
                    Err(zk::Error::NoNode) => return Ok(None),
                    Err(e) => return Err(self.err(e)),
                };
                match self
                    .within(client.delete(&path, Some(stat.version)))
                    .await?
                {
                    Ok(()) => Ok(Some(data)),
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => Ok(None),
                    Err(e) => Err(self.err(e)),
                }
            };
            match step.await {
                Ok(Some(data)) => taken.push(Parcel {
                    id,
                    body: String::from_utf8_lossy(&data).into_owned(),
                }),
                Ok(None) => {}
                Err(e) if taken.is_empty() => return Err(e),
                Err(_) => break,
            }
        }
        Ok(taken)
    }
}
